"""Every variant of every op this CPU runs (generic C++, AVX2, AVX-512 VNNI) against the
generic one and against torch: integer dot products bit for bit (inputs whose float sums are
exact), float results within rounding; each row of a batch computed exactly as that row
alone (batch invariance); and the variant cap (`use_variant`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from qkv.runtime.native import native_kernels
from qkv.runtime.native.ops import (active_variant, decode_attention, f32_linear, int4_linear, int4_linear_reference,
                            int8_linear, int8_linear_reference, pack_blocks, use_variant, variants)

pytestmark = pytest.mark.skipif(not native_kernels().available,
                                reason=f"qkv's kernels are not available here: {native_kernels().reason}")


def _each_variant(run):
    """{variant: run()} for every variant this CPU runs."""
    out = {}
    for variant in variants():
        with use_variant(variant):
            assert active_variant() == variant
            out[variant] = run()
    return out


def test_the_status_names_the_variant_that_runs_under_a_cap() -> None:
    """`--variant avx2` on an AVX-512 CPU runs the AVX2 kernels, and the status line says so."""
    from qkv.runtime.native.build import VARIANT_NAMES

    for variant in variants():
        with use_variant(variant):
            assert native_kernels().describe() == f"qkv's {VARIANT_NAMES[variant]} kernels"


def test_the_generic_variant_is_always_there_and_the_cap_restores() -> None:
    names = variants()
    assert names[0] == "generic" and set(names) <= {"generic", "avx2", "avx512"}
    best = active_variant()
    assert best == names[-1]
    with use_variant("generic"):
        assert active_variant() == "generic"
        with use_variant("avx512"):  # a cap above what the CPU has runs the CPU's best
            assert active_variant() == best
        assert active_variant() == "generic"
    assert active_variant() == best
    with pytest.raises(RuntimeError, match="generic, avx2 or avx512"):
        torch.ops.qkv.set_variant.default("sse9")


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 23), k=st.integers(1, 150), seed=st.integers(0, 2**16))
def test_int8_variants_give_the_integer_product_exactly(m, n, k, seed) -> None:
    """Integer activations and power-of-two scales: every sum is exact, so every variant must
    equal the int64 product bit for bit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-100, 101, (m, k), generator=g).float()
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = 2.0 ** torch.randint(-6, 0, (n,), generator=g).float()
    exact = (x.long() @ w.long().t()).double() * scales.double()  # (M, N)
    for variant, got in _each_variant(lambda: int8_linear(x, w, scales)).items():
        assert torch.equal(got.double(), exact), variant


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 23), blocks=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_int4_variants_give_the_integer_block_product_exactly(m, n, blocks, seed) -> None:
    """Activations that are their own int8 codes (each block's largest is 127: step 1) and
    power-of-two d and m: the block dots, scales and sums are all exact, so every variant
    (VNNI's four-block steps, AVX2's pairs and singles, the generic loop) equals torch's
    integer product bit for bit."""
    g = torch.Generator().manual_seed(seed)
    k = 32 * blocks
    x = torch.randint(-127, 128, (m, blocks, 32), generator=g)
    x[:, :, 0] = 127  # max|block| = 127: the step is exactly 1
    x = x.reshape(m, k).float()
    values = torch.randint(0, 16, (n, k), generator=g)
    d = (2.0 ** torch.randint(-6, -2, (n, blocks), generator=g).float()).half()
    mn = (-(2.0 ** torch.randint(-5, -1, (n, blocks), generator=g).float())).half()
    dots = torch.einsum("mgj,ngj->mng", x.long().reshape(m, blocks, 32), values.reshape(n, blocks, 32))
    sums = x.long().reshape(m, blocks, 32).sum(-1)  # (M, G)
    exact = (dots.double() * d.double()[None]).sum(-1) + sums.double() @ mn.double().t()  # (M, N)
    q = pack_blocks(values)
    for variant, got in _each_variant(lambda: int4_linear(x, q, d, mn)).items():
        assert torch.equal(got.double(), exact), variant


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 23), blocks=st.integers(1, 6), k=st.integers(1, 150),
       seed=st.integers(0, 2**16), bias=st.booleans())
def test_float_variants_agree_with_the_generic_one_and_torch(m, n, blocks, k, seed, bias) -> None:
    g = torch.Generator().manual_seed(seed)
    x, w, s = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.rand(n, generator=g) + 0.1
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    x4 = torch.randn(m, 32 * blocks, generator=g)
    q = torch.randint(0, 256, (n, 16 * blocks), dtype=torch.uint8, generator=g)
    d, mn = (torch.rand(n, blocks, generator=g) * 0.1).half(), (torch.randn(n, blocks, generator=g) * 0.1).half()
    b = torch.randn(n, generator=g) if bias else None
    products = {  # (the call, its reference, the sum of |terms| that bounds float summation-order error)
        "f32": (lambda: f32_linear(x, w, b), torch.nn.functional.linear(x, w, b),
                torch.nn.functional.linear(x.abs(), w.abs())),
        "int8": (lambda: int8_linear(x, w8, s, b), int8_linear_reference(x, w8, s, b),
                 int8_linear_reference(x.abs(), w8.abs(), s)),
        "int4": (lambda: int4_linear(x4, q, d, mn, b), int4_linear_reference(x4, q, d, mn, b),
                 int4_linear_reference(x4.abs(), q, d.abs(), mn.abs())),
    }
    for name, (run, expected, magnitude) in products.items():
        results = _each_variant(run)
        scale = 1e-5 * (1 + magnitude.abs().max().item())  # terms that cancel leave their rounding behind
        for variant, got in results.items():
            torch.testing.assert_close(got, expected, atol=scale, rtol=1e-5, msg=f"{name} {variant}")
            torch.testing.assert_close(got, results["generic"], atol=scale, rtol=1e-5, msg=f"{name} {variant}")


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 3), groups=st.integers(1, 3), h_kv=st.integers(1, 2), s=st.integers(1, 40),
       d=st.sampled_from([5, 8, 16, 24]), masked=st.booleans(), seed=st.integers(0, 2**16))
def test_attention_variants_agree_with_the_generic_one_and_torch(b, groups, h_kv, s, d, masked, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    h = groups * h_kv
    q, k, v = torch.randn(b, h, d, generator=g), torch.randn(b, h_kv, s, d, generator=g), torch.randn(b, h_kv, s, d, generator=g)
    visible = torch.rand(b, h, s, generator=g) > 0.3 if masked else None
    scores = torch.einsum("bhd,bhsd->bhs", q, k.repeat_interleave(groups, dim=1)) * d ** -0.5  # (B, H, S)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a head that sees nothing: zeros
    expected = torch.einsum("bhs,bhsd->bhd", weights, v.repeat_interleave(groups, dim=1))
    results = _each_variant(lambda: decode_attention(q, k, v, visible, d ** -0.5))
    for variant, got in results.items():
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5, msg=variant)
        torch.testing.assert_close(got, results["generic"], atol=2e-6, rtol=2e-5, msg=variant)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 9), groups=st.sampled_from([1, 2, 3, 4, 5, 8]), h_kv=st.integers(1, 2), s=st.integers(1, 60),
       d=st.sampled_from([5, 8, 16, 24, 32, 40, 44, 64]), masked=st.booleans(), seed=st.integers(0, 2**16))
@example(b=8, groups=4, h_kv=2, s=45, d=64, masked=False, seed=1)  # grouped, four queries at once, in registers
@example(b=8, groups=5, h_kv=1, s=29, d=44, masked=False, seed=2)  # grouped: four and one, head size in steps
def test_attention_on_avx512_gives_the_avx2_variants_bits(b, groups, h_kv, s, d, masked, seed) -> None:
    """AVX-512's attention is AVX2's operations lane for lane: the same bits, for one query head at
    a time (masked, or few rows) and for a row's grouped query heads at once (unmasked, enough
    rows), with head sizes ending in 16-, 8- and 1-lane steps (or held in registers: 16, 32, 64) and keys in
    16-, 8- and 1-key steps."""
    if "avx512" not in variants():
        pytest.skip("this CPU has no AVX-512")
    g = torch.Generator().manual_seed(seed)
    h = groups * h_kv
    q, k, v = torch.randn(b, h, d, generator=g), torch.randn(b, h_kv, s, d, generator=g), torch.randn(b, h_kv, s, d, generator=g)
    visible = torch.rand(b, h, s, generator=g) > 0.3 if masked else None
    results = _each_variant(lambda: decode_attention(q, k, v, visible, d ** -0.5))
    assert torch.equal(results["avx512"], results["avx2"])


@pytest.mark.parametrize("rows", [4, 5, 9, 13])
@pytest.mark.parametrize("blocks", [4, 9, 10, 18])
def test_int4_rows_of_a_prompt_give_each_row_alone_bit_for_bit(rows: int, blocks: int) -> None:
    """A prompt's rows of x at once: every variant's rows together equal each row alone, with
    blocks ending in the VNNI four-block steps, in pairs and singly, and outputs beyond the
    last four-row block; and the generic C++ loop's numbers (in another summation order; where
    every sum is exact, all variants give the same bits: the test above)."""
    g = torch.Generator().manual_seed(rows * 100 + blocks)
    n = 22  # five four-row blocks of outputs and two more
    x = torch.randn(rows, 32 * blocks, generator=g)
    q = torch.randint(0, 256, (n, 16 * blocks), dtype=torch.uint8, generator=g)
    d, mn = (torch.rand(n, blocks, generator=g) * 0.1).half(), (torch.randn(n, blocks, generator=g) * 0.1).half()
    b = torch.randn(n, generator=g)
    results = {}
    for variant in variants():
        with use_variant(variant):
            together = int4_linear(x, q, d, mn, b)
            alone = torch.cat([int4_linear(x[i:i + 1].contiguous(), q, d, mn, b) for i in range(rows)])
            assert torch.equal(together, alone), variant
            results[variant] = together
    for variant, got in results.items():  # the same math as the generic C++ loop, in another summation order
        torch.testing.assert_close(got, results["generic"], atol=2e-5, rtol=2e-5, msg=variant)


@pytest.mark.parametrize("rows", [2, 3, 8])
def test_each_row_of_a_batch_is_computed_as_that_row_alone(rows: int) -> None:
    """Batch invariance, bit for bit, in every variant: B rows at once == each row alone."""
    g = torch.Generator().manual_seed(rows)
    k, n = 200, 37  # a tail of inputs and of outputs beyond the vector and four-row steps
    x, w, s = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.rand(n, generator=g)
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    x4 = torch.randn(rows, 288, generator=g)
    q = torch.randint(0, 256, (n, 144), dtype=torch.uint8, generator=g)
    d, mn = (torch.rand(n, 9, generator=g) * 0.1).half(), (torch.randn(n, 9, generator=g) * 0.1).half()
    qa, ka, va = torch.randn(rows, 4, 16, generator=g), torch.randn(rows, 2, 30, 16, generator=g), torch.randn(rows, 2, 30, 16, generator=g)
    ops = {
        "f32": (lambda i: f32_linear(x[i].contiguous(), w, None)),
        "int8": (lambda i: int8_linear(x[i].contiguous(), w8, s, None)),
        "int4": (lambda i: int4_linear(x4[i].contiguous(), q, d, mn, None)),
        "attention": (lambda i: decode_attention(qa[i].contiguous(), ka[i].contiguous(), va[i].contiguous(), None, 0.25)),
    }
    everything = slice(0, rows)
    for variant in variants():
        with use_variant(variant):
            for name, run in ops.items():
                together = run(everything)
                alone = torch.cat([run(slice(i, i + 1)) for i in range(rows)])
                assert torch.equal(together, alone), f"{name} {variant}"
