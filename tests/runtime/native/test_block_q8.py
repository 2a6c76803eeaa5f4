"""qkv::block_linear_q8: a GGUF matrix times activations rounded per 32 inputs, with integer
dot products. The reference is the gguf library's dequantized weights times the same rounded
activations in float64 (qkv.runtime.native.block_ops.rounded_activations rounds as the kernel does):
the kernel must agree to float32 summation order, in every variant, and give each row the
same bits whatever the other rows are."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.models.gguf.stored import StoredBlocks
from qkv.runtime.native.block_ops import NATIVE_TYPES, block_linear_q8, block_products_status, rounded_activations
from tests.models.gguf.block_files import random_blocks

pytestmark = pytest.mark.skipif(block_products_status() is not None, reason="qkv's block products do not build here")
ISAS = ["generic", *(["avx512"] if "avx512" in torch.ops.qkv.variants.default().split(",") else [])]
TYPES = sorted(NATIVE_TYPES, key=int)


def _matrix(block_type: Q, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    raw = random_blocks(block_type, (n, k), np.random.default_rng(seed))
    blocks = torch.from_numpy(np.ascontiguousarray(raw))
    return blocks, StoredBlocks(blocks, block_type, (n, k)).dequantize().double()


@settings(max_examples=60, deadline=None)
@given(block_type=st.sampled_from(TYPES), isa=st.sampled_from(ISAS), rows=st.integers(1, 6),
       blocks_of_256=st.integers(0, 3), blocks_of_32=st.integers(0, 7), seed=st.integers(0, 2**16))
def test_the_product_is_the_dequantized_weights_times_the_rounded_activations(
        block_type: Q, isa: str, rows: int, blocks_of_256: int, blocks_of_32: int, seed: int) -> None:
    super_blocks = block_type in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
    # every kernel's paths: 16-block groups, pairs, a lone block (K = 32, 96, ...)
    k = 256 * max(blocks_of_256, 1) if super_blocks else 256 * blocks_of_256 + 32 * blocks_of_32 or 32
    blocks, w = _matrix(block_type, 9, k, seed)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 3
    bias = torch.randn(9)
    rounded = rounded_activations(x).double()
    expected = rounded @ w.t() + bias.double()
    bound = 4 * k * torch.finfo(torch.float32).eps * (rounded.abs() @ w.abs().t() + bias.double().abs()) + 1e-30
    got = block_linear_q8(x, blocks, block_type, bias, isa=isa).double()
    assert bool(((got - expected).abs() <= bound).all())


@pytest.mark.parametrize("block_type", TYPES)
def test_a_row_gets_the_same_bits_whatever_rows_are_beside_it(block_type: Q) -> None:
    blocks, _ = _matrix(block_type, 40, 512, 1)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    for isa in ISAS:
        together = block_linear_q8(x, blocks, block_type, isa=isa)
        alone = torch.cat([block_linear_q8(x[i:i + 1], blocks, block_type, isa=isa) for i in range(5)])
        assert torch.equal(together, alone)


def test_a_zero_block_of_activations_rounds_to_zero_and_bad_shapes_are_named() -> None:
    blocks, w = _matrix(Q.Q4_K, 4, 256, 3)
    x = torch.zeros(1, 256)
    x[0, 40] = 1.0  # one nonzero input: every other block's step is 0
    rounded = rounded_activations(x).double()
    assert torch.allclose(block_linear_q8(x, blocks, Q.Q4_K).double(), rounded @ w.t(), rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="K must be whole blocks"):
        block_linear_q8(torch.zeros(1, 128), blocks[:, :72].contiguous(), Q.Q4_K)
