"""Input-major float layers compute what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.runtime.linear.transposed import InputMajorLinear, store_input_major


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7])
def test_input_major_layer_equals_the_linear_layer(bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(24, 40, bias=bias)
    layer = InputMajorLinear(linear)
    x = torch.randn(2, rows, 24)
    torch.testing.assert_close(layer(x), linear(x))
    assert layer.weight_t.is_contiguous() and torch.equal(layer.weight, linear.weight)


def test_only_wide_layers_are_stored_input_major_and_the_model_is_unchanged() -> None:
    torch.manual_seed(0)
    model = GPT2Decoder(GPTConfig(vocab_size=96, context_length=32, emb_dim=64, n_heads=4, n_layers=2,
                               drop_rate=0.0)).eval()
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        before = model(ids)
        store_input_major(model)  # what prepare_for_decoding does where qkv's kernels cannot be built
        after = model(ids)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    wide = [m for m in model.modules() if isinstance(m, InputMajorLinear)]
    narrow = [m for m in model.modules() if type(m) is nn.Linear]
    assert wide and all(m.out_features >= m.in_features for m in wide)
    assert narrow and all(m.out_features < m.in_features for m in narrow)  # the MLP's down projection
    assert store_input_major(model) == 0  # nothing left to convert
