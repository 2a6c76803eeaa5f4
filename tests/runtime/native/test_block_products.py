"""qkv::block_linear (block_products.cpp) against the gguf library's dequantized weights: every
block type, every instruction-set variant this CPU runs, any batch size."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.models.gguf import dequantize as gguf_blocks
from qkv.runtime.native import native_kernels
from qkv.runtime.native import block_ops

pytestmark = pytest.mark.skipif(not native_kernels().available,
                                reason=f"qkv's kernels are not available here: {native_kernels().reason}")

TYPES = sorted(block_ops.NATIVE_TYPES, key=int)


def random_matrix(block_type: Q, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks (N, bytes) uint8 of random bytes with finite float16 scales, the gguf library's
    float32 weights (N, K) for them)."""
    form = gguf_blocks.BLOCK_FORMATS[block_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // form.weights, form.size), dtype=np.uint8)
    for start in form.halves:
        raw[:, start : start + 2] = rng.normal(scale=0.1, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    blocks = torch.from_numpy(raw.reshape(rows, -1).copy())
    return blocks, torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), block_type)).reshape(rows, cols)


def rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far a float32 sum of K products may lie from the exact one: K eps sum |x w| (twice, for slack)."""
    k = x.shape[1]
    return 2 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().t())


@pytest.mark.parametrize("block_type", TYPES, ids=lambda t: t.name)
def test_unit_inputs_give_the_gguf_librarys_weights_exactly(block_type: Q) -> None:
    """x = the identity: y[k, n] is weight (n, k) as the kernel decoded it, which must be the
    gguf library's value (so no step of the decoding is rounded differently)."""
    blocks, w = random_matrix(block_type, 5, 512, seed=int(block_type))
    eye = torch.eye(512)
    for isa in block_ops.available_isas():
        assert torch.equal(block_ops.block_linear(eye, blocks, block_type, isa=isa).t(), w), isa
        # a decode step (one row: weights decoded in registers) reads the same weights
        assert torch.equal(block_ops.block_linear(eye[300:301], blocks, block_type, isa=isa)[0], w[:, 300]), isa


@pytest.mark.parametrize("block_type", TYPES, ids=lambda t: t.name)
def test_products_are_the_dequantized_product_within_float_rounding(block_type: Q) -> None:
    blocks, w = random_matrix(block_type, 24, 768, seed=3)
    x = torch.randn(6, 768, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(24, generator=torch.Generator().manual_seed(1))
    exact = x.double() @ w.double().t()
    y = block_ops.block_linear(x, blocks, block_type)
    assert ((y.double() - exact).abs() <= rounding_bound(x, w)).all()
    with_bias = block_ops.block_linear(x, blocks, block_type, bias)
    assert torch.equal(with_bias, y + bias)  # one rounding: the sum, then the bias added


@settings(max_examples=40, deadline=None)
@given(block_type=st.sampled_from(TYPES), blocks_per_row=st.integers(1, 9), rows=st.integers(1, 9),
       batch=st.integers(1, 7), seed=st.integers(0, 2**31))
def test_every_variant_and_batch_size_gives_the_same_bits(block_type: Q, blocks_per_row: int, rows: int,
                                                           batch: int, seed: int) -> None:
    """One summation order: the generic C++, AVX2 and AVX-512 agree bit for bit, and a row of
    x gets the same numbers alone as in any batch (decode steps and prefill alike)."""
    cols = blocks_per_row * gguf_blocks.BLOCK_FORMATS[block_type].weights
    blocks, w = random_matrix(block_type, rows, cols, seed)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(seed))
    generic = block_ops.block_linear(x, blocks, block_type, isa="generic")
    assert ((generic.double() - x.double() @ w.double().t()).abs() <= rounding_bound(x, w)).all()
    for isa in block_ops.available_isas():
        assert torch.equal(block_ops.block_linear(x, blocks, block_type, isa=isa), generic), isa
    alone = torch.cat([block_ops.block_linear(x[i : i + 1], blocks, block_type) for i in range(batch)])
    assert torch.equal(alone, generic)


def test_bad_arguments_are_refused_by_name() -> None:
    blocks, _ = random_matrix(Q.Q4_K, 2, 256, seed=0)
    with pytest.raises(RuntimeError, match="blocks must be contiguous uint8"):
        block_ops.block_linear(torch.randn(1, 512), blocks, Q.Q4_K)  # K of another matrix
    with pytest.raises(RuntimeError, match="not a GGUF block type"):
        torch.ops.qkv.block_linear.default(torch.randn(1, 256), blocks, 9, None, 0)  # Q8_1
    with pytest.raises(RuntimeError, match="x must be a contiguous float32"):
        block_ops.block_linear(torch.randn(1, 256).double(), blocks, Q.Q4_K)
    with pytest.raises(RuntimeError, match="bias must be"):
        block_ops.block_linear(torch.randn(1, 256), blocks, Q.Q4_K, torch.zeros(3))


def test_the_self_test_passes_and_the_variants_are_listed() -> None:
    assert block_ops.block_products_status() is None
    assert block_ops.available_isas()[0] == "generic"
