"""Weight-only int8 and int4 layers: error bounds from their definitions, the kernels against
the dequantized weights, whole models quantized in place, and the quality cost on the real
SmolLM2 (perplexity within the issue's bounds of bfloat16)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qkv.models.gpt2 import GPTConfig, GPT2Decoder
from qkv.runtime.native import native_kernels
from qkv.runtime.native.ops import dequantize_blocks, round_activations, unpack_blocks
from qkv.runtime.linear import Int4Linear, Int8Linear, quantize_groups, quantize_rows
from qkv.runtime.linear import quantize

from qkv.runtime.prepare import prepare_for_decoding
from qkv.eval.perplexity import perplexity

VERDICT = Path(__file__).resolve().parents[4] / "shared" / "data" / "the-verdict.txt"


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 24), k=st.integers(1, 40), seed=st.integers(0, 2**16), scale=st.floats(1e-3, 1e3))
def test_int8_rows_are_within_half_a_step(n, k, seed, scale) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * scale
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert bool(((w - q.float() * s[:, None]).abs() <= s[:, None] / 2 * (1 + 1e-5)).all())


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 16), groups=st.integers(1, 4), seed=st.integers(0, 2**16), scale=st.floats(1e-3, 1e3),
       constant_block=st.booleans())
def test_int4_blocks_are_within_half_a_step(n, groups, seed, scale, constant_block) -> None:
    w = torch.randn(n, groups * 32, generator=torch.Generator().manual_seed(seed)) * scale
    if constant_block:
        w[0, :32] = w[0, 0]  # max == min: the block is m exactly
    q, d, m = quantize_groups(w)
    values = unpack_blocks(q)
    assert q.shape == (n, groups * 16) and int(values.max()) <= 15
    deq = dequantize_blocks(q, d, m)
    step = d.float().repeat_interleave(32, dim=1)  # (N, K)
    # half a step, plus float16's rounding of d and m (relative 2^-11 each, 15 d at most)
    slack = (m.float().abs() + 15 * d.float()).repeat_interleave(32, dim=1) * 2.0**-10
    assert bool(((w - deq).abs() <= step / 2 * (1 + 1e-4) + slack + 1e-30).all())
    if constant_block:
        assert bool((deq[0, :32] == m[0, 0].float()).all())


NATIVE = [True, False] if native_kernels().available else [False]


@pytest.mark.parametrize("native", NATIVE, ids=lambda n: "qkv-kernels" if n else "torch-reference")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", [Int8Linear, Int4Linear])
@pytest.mark.parametrize("rows", [1, 3, 40, 200], ids=lambda r: f"{r}rows")
def test_kernels_compute_the_dequantized_product(kind, dtype, native, rows) -> None:
    """Every call runs the kernels' math, on qkv's kernels or on their PyTorch reference alike:
    int4 multiplies activations rounded to int8 per block of 32 (exactly, up to float
    summation order), a prompt longer than NATIVE_ROWS too, in one float product (so a prompt
    and a decode step compute one precision's math)."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    layer = kind.from_linear(linear, native=native)
    assert layer.native == native
    x = torch.randn(rows, 64).to(dtype)
    through = x.float()
    if kind is Int4Linear:
        through = round_activations(through)
    expected = F.linear(through, layer.dequantized(torch.float32), linear.bias.detach())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)  # bfloat16's output
    torch.testing.assert_close(layer(x).float(), expected, **tol)
    # and the dequantized weight is the float one, within the quantization step
    assert (layer.dequantized() - linear.weight.detach()).abs().max() < 0.05


@pytest.mark.skipif(not native_kernels().available, reason="needs qkv's kernels to compare with")
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 20), n=st.integers(1, 40), blocks=st.integers(1, 6), bias=st.booleans(),
       four_bits=st.booleans(), seed=st.integers(0, 2**16))
def test_the_torch_reference_gives_the_kernels_numbers(rows, n, blocks, bias, four_bits, seed) -> None:
    """Without a compiler a layer runs `int8_linear_reference` / `int4_linear_reference`: the
    native op's numbers to float32 rounding, on random shapes (the int4 codes are the same, so
    no activation lands on another step)."""
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(32 * blocks, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, 32 * blocks, generator=g) * 0.1)
    kind = Int4Linear if four_bits else Int8Linear
    native, reference = kind.from_linear(linear, native=True), kind.from_linear(linear, native=False)
    assert native.native and not reference.native
    x = torch.randn(rows, 32 * blocks, generator=g)
    got, want = native(x), reference(x)
    torch.testing.assert_close(got, want, atol=2e-6 * (1 + want.abs().max().item()), rtol=1e-5)


@pytest.mark.skipif(not native_kernels().available, reason="needs qkv's kernels to compare with")
@pytest.mark.parametrize("kind", [Int8Linear, Int4Linear])
def test_the_reference_takes_wide_layers_in_chunks_with_the_same_numbers(kind) -> None:
    """An output head's width: the reference works REFERENCE_CHUNK outputs at a time."""
    from qkv.runtime.native.ops import REFERENCE_CHUNK

    torch.manual_seed(5)
    linear = nn.Linear(64, 2 * REFERENCE_CHUNK + 37)
    x = torch.randn(2, 64)
    want = kind.from_linear(linear, native=True)(x)
    torch.testing.assert_close(kind.from_linear(linear, native=False)(x), want, atol=1e-5, rtol=1e-5)


WITHOUT_COMPILER = """
import json, sys, torch
from qkv.runtime.linear import Int4Linear
from torch import nn
torch.manual_seed(0)
linear = nn.Linear(96, 24)
layer = Int4Linear.from_linear(linear)
x = torch.randn(3, 96)
print(json.dumps({"native": layer.native, "y": layer(x).tolist(), "state": {k: v.tolist() for k, v in layer.state_dict().items()}}))
"""


@pytest.mark.skipif(not native_kernels().available, reason="needs qkv's kernels to compare with")
def test_without_a_compiler_int4_gives_the_kernels_numbers_and_says_so_once(tmp_path) -> None:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "QKV_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", WITHOUT_COMPILER], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    lines = [line for line in done.stderr.splitlines() if "slower path" in line]
    assert not result["native"] and len(lines) == 1 and "compiler" in lines[0]
    torch.manual_seed(0)
    linear = nn.Linear(96, 24)
    layer = Int4Linear.from_linear(linear)  # here: on qkv's kernels
    assert layer.native
    for name, value in layer.state_dict().items():  # the same blocks
        assert torch.equal(value, torch.tensor(result["state"][name], dtype=value.dtype))
    x = torch.randn(3, 96)
    torch.testing.assert_close(torch.tensor(result["y"]), layer(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantize_replaces_every_linear_and_keeps_the_embedding(kind) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=96, context_length=32, emb_dim=64, n_heads=4, n_layers=2, drop_rate=0.0)
    model = GPT2Decoder(cfg).eval()
    model.tie_weights()
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        before = model(ids)
        quantize(model, kind)
        after = model(ids)
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.tok_emb, nn.Embedding)  # one row per token: kept in float
    assert isinstance(model.out_head, Int8Linear)  # the head stays at 8 bits, int4 or not
    four_bits = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(four_bits) == (0 if kind == "int8" else 2 * 6)  # q, k, v, o and two MLP layers
    relative = ((after - before).abs().max() / before.abs().max()).item()
    assert relative < (0.02 if kind == "int8" else 0.2)


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="int8, int4"):
        quantize(nn.Linear(4, 4), "int3")


@pytest.mark.xdist_group("smollm2")
def test_smollm2_perplexity_cost_within_the_bounds(smollm2_model) -> None:
    """The issue's quality bounds on real weights (a 384-token excerpt of the book's text,
    the README's full measurement is in benchmarks/HISTORY.md): int8 within 1% and int4
    within 3% of bfloat16's perplexity, each prepared as `qkv generate` prepares it
    (bfloat16 activations for all three)."""
    model, tokenizer = smollm2_model
    text = VERDICT.read_text(encoding="utf-8")
    ids = torch.tensor(tokenizer.encode(text).ids[:384])
    scores = {}
    for kind in ("bfloat16", "int8", "int4"):
        candidate = copy.deepcopy(model)
        prepare_for_decoding(candidate, precision=kind, compile=False)
        scores[kind] = perplexity(candidate, ids, context_length=384, stride=383).perplexity
    assert math.isfinite(scores["bfloat16"])
    assert scores["int8"] / scores["bfloat16"] < 1.01, scores
    assert scores["int4"] / scores["bfloat16"] < 1.03, scores


def test_int4_leaves_layers_its_kernel_cannot_take_at_int8() -> None:
    """Outputs not a multiple of 16, or inputs not a multiple of the group: int8 instead."""
    stack = nn.ModuleList([nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 40), nn.Linear(40, 64))
                           for _ in range(2)])
    model = nn.Module()
    model.layers = stack
    quantize(model, "int4")
    kinds = [type(m) for m in stack[0]]
    assert kinds == [Int4Linear, Int8Linear, Int8Linear]
