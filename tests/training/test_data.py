"""Windows and batches against the book's construction and the sharding invariants."""

from __future__ import annotations

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from qkv.training.data import BatchSchedule, TokenWindows, split_text


def book_windows(ids: list[int], length: int, stride: int) -> tuple[list[list[int]], list[list[int]]]:
    """Chapter 2's GPTDatasetV1 loop: inputs ids[i:i+L], targets ids[i+1:i+L+1]."""
    inputs, targets = [], []
    for i in range(0, len(ids) - length, stride):
        inputs.append(ids[i : i + length])
        targets.append(ids[i + 1 : i + length + 1])
    return inputs, targets


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 80), st.integers(1, 12), st.integers(1, 12))
def test_windows_equal_the_books_dataset(n: int, length: int, stride: int) -> None:
    ids = list(range(100, 100 + n))
    windows = TokenWindows(ids, length, stride)
    inputs, targets = book_windows(ids, length, stride)
    assert len(windows) == len(inputs)
    if inputs:
        x, y = windows.batch(torch.arange(len(windows)))
        assert x.tolist() == inputs
        assert y.tolist() == targets


def test_split_is_the_books_ninety_percent_of_characters() -> None:
    text = "abcdefghij" * 7
    train, val = split_text(text)
    assert train + val == text
    assert len(train) == int(0.9 * len(text))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 60), st.integers(1, 5), st.integers(1, 4), st.integers(0, 30))
def test_shards_make_up_the_single_process_batch(windows: int, batch: int, world: int, step: int) -> None:
    global_batch = batch * world
    assume(windows >= global_batch)
    sharded = BatchSchedule(windows, batch, world, seed=7)
    single = BatchSchedule(windows, global_batch, 1, seed=7)
    assert sharded.steps_per_epoch == single.steps_per_epoch
    ranks = torch.cat([sharded.indices(step, rank) for rank in range(world)])
    assert ranks.tolist() == single.indices(step, 0).tolist()


def test_an_epoch_visits_windows_once_and_epochs_reshuffle() -> None:
    schedule = BatchSchedule(num_windows=23, batch_size=4, world_size=1, seed=1)
    assert schedule.steps_per_epoch == 5  # the book drops the last, partial batch
    first = torch.cat([schedule.indices(s, 0) for s in range(5)])
    assert len(set(first.tolist())) == 20
    second = torch.cat([schedule.indices(s, 0) for s in range(5, 10)])
    assert first.tolist() != second.tolist()
    assert schedule.indices(7, 0).tolist() == schedule.indices(7, 0).tolist()  # order is a function of the step
