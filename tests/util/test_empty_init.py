"""qkv.util.empty_init: parameters on the meta device, buffers real, this thread only."""

from __future__ import annotations

import threading

import torch
from torch import nn

from qkv.attention.rope import RotaryEmbedding
from qkv.util.empty_init import meta_names, parameters_on_meta


def test_parameters_are_meta_and_computed_buffers_real() -> None:
    with parameters_on_meta():
        linear = nn.Linear(8, 4)
        rope = RotaryEmbedding(16, theta=500.0)
    assert linear.weight.is_meta and linear.bias.is_meta and linear.weight.shape == (4, 8)
    assert linear.weight.requires_grad and isinstance(linear.weight, nn.Parameter)
    assert not rope.inv_freq.is_meta
    assert torch.equal(rope.inv_freq, RotaryEmbedding(16, theta=500.0).inv_freq)
    assert meta_names(nn.Sequential(linear, rope)) == ["0.weight", "0.bias"]


def test_only_inside_and_only_in_this_thread() -> None:
    made: list[nn.Linear] = []
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        entered.wait()
        made.append(nn.Linear(2, 2))
        release.set()

    worker = threading.Thread(target=other)
    worker.start()
    with parameters_on_meta():
        with parameters_on_meta():  # nesting keeps it on until the outer one ends
            pass
        assert nn.Linear(2, 2).weight.is_meta
        entered.set()
        release.wait(timeout=30)
    worker.join()
    assert not made[0].weight.is_meta
    assert not nn.Linear(2, 2).weight.is_meta


def test_loading_with_assign_fills_the_model() -> None:
    reference = nn.Linear(8, 4)
    with parameters_on_meta():
        linear = nn.Linear(8, 4)
    linear.load_state_dict(reference.state_dict(), assign=True)
    assert meta_names(linear) == []
    assert torch.equal(linear(torch.ones(1, 8)), reference(torch.ones(1, 8)))
