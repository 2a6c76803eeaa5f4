"""Int8 and decode linears against the float reference, with tolerances derived from the
quantization step; and quantized GPT models against the float ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qkv.generation import generate
from qkv.models.gpt2 import GPTConfig, GPTModel
from qkv.perf import DecodeLinear, Int8Linear, quantize_int8, quantize_rows, use_decode_linears
from qkv.perf import linear as perf_linear


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 40), seed=st.integers(0, 2**16), spread=st.floats(1e-3, 1e3))
def test_quantize_rows_error_is_at_most_half_a_step(n: int, k: int, seed: int, spread: float) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * spread
    q, scales = quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    # The largest weight of each row lands on +-127 exactly.
    assert torch.equal(q.abs().amax(dim=1), torch.full((n,), 127, dtype=torch.int8))
    error = (w - q.float() * scales[:, None]).abs()
    assert bool((error <= scales[:, None] / 2 * (1 + 1e-5)).all())


def _bound(x: torch.Tensor, layer: Int8Linear, slack: float) -> torch.Tensor:
    """|y - y_float| <= sum_k |x_k| * s_n / 2 (each weight off by at most half a step)."""
    return (x.abs().float().sum(-1, keepdim=True) * layer.scales / 2) * (1 + slack) + slack


@pytest.mark.parametrize(
    ("dtype", "packed", "slack"),
    [(torch.float32, True, 1e-4), (torch.bfloat16, True, 2e-2), (torch.float64, False, 1e-9)],
)
def test_int8_linear_is_within_the_quantization_bound(dtype: torch.dtype, packed: bool, slack: float) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    q = Int8Linear.from_linear(linear)
    x = torch.randn(3, 5, 96)
    reference = F.linear(x.double(), linear.weight.double(), linear.bias.double())
    uses_pack = perf_linear._INT8PACK is not None and dtype in perf_linear._INT8PACK_DTYPES
    assert uses_pack == (packed and perf_linear._INT8PACK is not None)
    out = q(x.to(dtype))
    assert out.shape == (3, 5, 40) and out.dtype == dtype
    # bfloat16 activations and outputs round too: half their precision times |y| on top.
    extra = reference.abs() * (2**-8 if dtype == torch.bfloat16 else 0)
    assert bool(((out.double() - reference).abs() <= _bound(x, q, slack).double() + extra).all())
    # and it computes exactly the dequantized weight's product (up to float rounding)
    exact = F.linear(x.double(), q.dequantized(torch.float64), linear.bias.double())
    torch.testing.assert_close(out.double(), exact, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=5e-2 if dtype == torch.bfloat16 else 1e-5)


def test_compiled_paths_match_eager() -> None:
    """Under torch.compile both linears take the multiply-and-reduce path for one row."""
    torch.manual_seed(1)
    linear = nn.Linear(64, 48)
    decode, q = DecodeLinear.from_linear(linear), Int8Linear.from_linear(linear)
    assert decode.weight is linear.weight and decode.bias is linear.bias
    for module in (decode, q):
        compiled = torch.compile(module, backend="eager", dynamic=False)
        for shape in [(1, 1, 64), (2, 3, 64)]:
            x = torch.randn(*shape)
            torch.testing.assert_close(compiled(x), module(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 64)
    assert torch.equal(decode(x), linear(x))  # eager: exactly nn.Linear


def _tiny_gpt(seed: int = 0, tied: bool = False) -> GPTModel:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=97, context_length=64, emb_dim=64, n_heads=4, n_layers=2, drop_rate=0.0)
    model = GPTModel(cfg).eval()
    if tied:
        model.tie_weights()
    return model


def test_quantized_gpt_logits_and_greedy_tokens_stay_close() -> None:
    model = _tiny_gpt(tied=True)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        reference = model(ids)
    reference_tokens = generate(model, ids[:, :8], 16)
    quantize_int8(model)
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.out_head, Int8Linear)
    assert model.tok_emb.weight.dtype == torch.float32  # the embedding keeps its float table
    with torch.inference_mode():
        logits = model(ids)
    # Relative error of int8 per-row quantization is below 1/254 per weight; through two
    # layers it stays well under 5% of the logit range.
    assert (logits - reference).abs().max() <= 0.05 * reference.abs().max()
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    tokens = generate(model, ids[:, :8], 16)
    assert (tokens == reference_tokens).float().mean() >= 0.8


def test_decode_linears_keep_outputs_and_ties() -> None:
    model = _tiny_gpt(tied=True)
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        before = model(ids)
    use_decode_linears(model)
    assert isinstance(model.out_head, DecodeLinear) and model.weights_tied
    assert model.out_head.weight.t().is_contiguous()  # column-major, the tied table too
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), before, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(ids[:, :1]), before[:, :1], rtol=1e-5, atol=1e-5)


def test_row_layout_for_compiling_undoes_the_column_layout() -> None:
    model = _tiny_gpt(tied=True)
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        before = model(ids)
    use_decode_linears(model)  # column-major first, then back to the checkpoint's layout
    use_decode_linears(model, layout="row")
    assert isinstance(model.out_head, DecodeLinear) and model.weights_tied
    assert all(m.weight.is_contiguous() for m in model.modules() if isinstance(m, DecodeLinear))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), before, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="layout"):
        DecodeLinear.from_linear(nn.Linear(3, 2), layout="diagonal")


def test_float32_matvec_copy_for_bfloat16_layers() -> None:
    torch.manual_seed(5)
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    reference = F.linear  # the bfloat16 layer's own product, computed in float64
    decode = DecodeLinear.from_linear(linear, matvec_dtype=torch.float32)
    assert decode.matvec_weight.dtype == torch.float32
    assert torch.equal(decode.matvec_weight, linear.weight.float())  # bf16 -> f32 is exact
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    exact = reference(x.double(), linear.weight.double(), linear.bias.double())
    out = decode(x)
    assert out.dtype == torch.bfloat16
    # float32 accumulation, then one rounding to bfloat16 (relative 2^-8)
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-6)
    rows = torch.randn(3, 64, dtype=torch.bfloat16)  # prompts use the bfloat16 weight
    assert torch.equal(decode(rows), linear(rows))
