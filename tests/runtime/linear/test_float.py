"""Float32 layers on qkv's kernel compute nn.Linear's product (decode-sized calls through the
kernel, prompts through F.linear), and float32 decoding of a prepared model keeps the
model's logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qkv.generation import generate
from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.runtime.native import native_kernels
from qkv.runtime.linear.float import NativeFloatLinear
from qkv.runtime.prepare import prepare_for_decoding

pytestmark = pytest.mark.skipif(not native_kernels().available,
                                reason=f"qkv's kernels are not available here: {native_kernels().reason}")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_native_float_layer_equals_the_linear_layer(bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(72, 44, bias=bias)
    layer = NativeFloatLinear(linear)
    x = torch.randn(2, rows, 72)
    torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)
    assert layer.weight.data_ptr() == linear.weight.data_ptr()  # float32 weights are shared, not copied


def test_prepared_float32_model_keeps_its_logits_and_greedy_tokens() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=96, context_length=48, emb_dim=64, n_heads=4, n_layers=2, drop_rate=0.0)
    model, reference = GPT2Decoder(cfg).eval(), GPT2Decoder(cfg).eval()
    model.tie_weights()
    reference.tie_weights()
    reference.load_state_dict(model.state_dict())
    setup = prepare_for_decoding(model, precision="float32", compile=False)
    assert setup.kernels is not None and setup.kernels.available
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.out_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()  # the tie survives
    ids = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids), rtol=1e-5, atol=1e-5)
    assert torch.equal(generate(model, ids, 12), generate(reference, ids, 12))
