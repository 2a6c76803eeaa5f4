"""qkv::block_linear (block_products.cpp) and the block-format table (block_format.cpp): a GGUF
matrix times activations rounded as its weight type multiplies them (per 32 inputs for
32-weight blocks, per 256 for the K-quants and IQ4_XS, not at all for F16 / BF16, whose products are
float32 sums of w x). The reference is the gguf library's dequantized
weights (`gguf.quants.dequantize`) times activations rounded here in numpy, in float64: every
variant this CPU runs (generic C++, AVX2, AVX-512) must agree with it to float32 rounding of
the per-block sums' combination, with the generic variant likewise, and give each row the
same bits whatever the other rows are."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.runtime.native import block_ops
from qkv.runtime.native.ops import use_variant, variants
from tests.models.gguf.block_files import random_blocks

pytestmark = pytest.mark.skipif(block_ops.block_products_status() is not None, reason="qkv's block products do not build here")

TYPES = sorted(block_ops.NATIVE_TYPES, key=int)
SUPER_BLOCKS = {t for t in TYPES if gguf.GGML_QUANT_SIZES[t][0] == 256}  # the K-quants, IQ4_XS, the grid types
GRIDS = {Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M}  # codes from a grid, a multiplier per 16 or 32
GENERIC_ORDER = GRIDS | {Q.Q2_K, Q.Q3_K}  # every variant adds the super-blocks' exact sums in the generic order
FLOATS = {Q.F16, Q.BF16}  # plain 16-bit values, multiplied against float32 activations as they are


def matrix(block_type: Q, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks (N, bytes) uint8, random bytes with finite float16 scales; the gguf library's
    weights (N, K) for them, float64)."""
    raw = np.ascontiguousarray(random_blocks(block_type, (n, k), np.random.default_rng(seed)))
    return torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, block_type)).reshape(n, k).double()


def numpy_rounded(x: torch.Tensor, step_size: int) -> torch.Tensor:
    """x rounded per `step_size` inputs as llama.cpp's Q8_0 / Q8_K do in spirit: step max|x| / 127
    in float32, codes x * (1 / step) rounded to nearest, ties to even (numpy's rint)."""
    groups = x.numpy().astype(np.float32).reshape(x.shape[0], -1, step_size)
    step = (np.abs(groups).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inverse = np.where(step > 0, np.float32(1) / np.where(step > 0, step, 1), 0).astype(np.float32)
    codes = np.rint(groups * inverse)
    assert np.abs(codes).max() <= 127
    return torch.from_numpy((codes * step).reshape(x.shape).astype(np.float64))


def reference_activations(x: torch.Tensor, block_type: Q) -> torch.Tensor:
    """x as `block_type`'s products take it, float64: rounded per 32 or 256, or (F16, BF16) x itself."""
    step = block_ops.activation_step(block_type)
    return x.double() if step == 0 else numpy_rounded(x, step)


def run(x: torch.Tensor, blocks: torch.Tensor, block_type: Q, variant: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    with use_variant(variant):
        return block_ops.block_linear(x, blocks, block_type, bias)


@pytest.mark.parametrize("block_type", TYPES, ids=lambda t: t.name)
def test_the_tables_decode_is_the_gguf_librarys(block_type: Q) -> None:
    blocks, w = matrix(block_type, 5, 512, seed=int(block_type))
    assert torch.equal(block_ops.block_decode(blocks, block_type, 512).double(), w)


def test_the_cpp_block_table_is_the_gguf_packages_and_pythons() -> None:
    """One block-format table: the C++ one (block_format.cpp) lists exactly the native types with
    gguf's GGML_QUANT_SIZES (F16 / BF16: gguf's one value of 2 bytes a "block", taken 32 at a
    time), and the activation step qkv's Python rounds with."""
    table = block_ops.block_table()
    assert set(table) == set(TYPES)
    for block_type, (weights, size, step) in table.items():
        if block_type in FLOATS:
            assert gguf.GGML_QUANT_SIZES[block_type] == (1, 2) and (weights, size) == (32, 64), block_type.name
        else:
            assert (weights, size) == gguf.GGML_QUANT_SIZES[block_type], block_type.name
        assert step == block_ops.activation_step(block_type), block_type.name


def test_the_activation_step_is_the_weight_types() -> None:
    assert {t for t in TYPES if block_ops.activation_step(t) == 256} == SUPER_BLOCKS
    assert {t for t in TYPES if block_ops.activation_step(t) == 0} == FLOATS
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0)) * 5
    for block_type in (Q.Q4_0, Q.Q6_K):
        assert torch.equal(block_ops.rounded_activations(x, block_type).double(),
                           numpy_rounded(x, block_ops.activation_step(block_type)))
    assert torch.equal(block_ops.rounded_activations(x, Q.F16), x)  # not rounded


@pytest.mark.parametrize("block_type", sorted(FLOATS, key=int), ids=lambda t: t.name)
def test_a_16_bit_matrix_multiplies_the_activations_unrounded(block_type: Q) -> None:
    """F16 / BF16 against float32 activations as they are: within float32 summation rounding of
    the exact product, much closer than any rounding of x to 8 bits would allow (the products of
    x rounded per 32 lie a hundred times further off)."""
    blocks, w = matrix(block_type, 16, 2048, seed=9)
    x = torch.randn(3, 2048, generator=torch.Generator().manual_seed(10))
    exact = x.double() @ w.t()
    rounding = (numpy_rounded(x, 32) @ w.t() - exact).abs().max()
    for variant in variants():
        error = (run(x, blocks, block_type, variant).double() - exact).abs()
        assert bool((error <= block_ops.product_bound(x.double(), w, 2048, block_type)).all()), variant
        assert error.max() * 100 < rounding, variant


@settings(max_examples=80, deadline=None)
@given(block_type=st.sampled_from(TYPES), rows=st.integers(1, 6), outputs=st.integers(1, 11),
       blocks_of_256=st.integers(0, 3), blocks_of_32=st.integers(0, 7), scale=st.sampled_from([1e-3, 1.0, 40.0]),
       seed=st.integers(0, 2**16))
def test_every_variant_is_the_dequantized_weights_times_the_rounded_activations(
        block_type: Q, rows: int, outputs: int, blocks_of_256: int, blocks_of_32: int, scale: float, seed: int) -> None:
    # every kernel's paths: pairs of 32-blocks and a lone one (K = 32, 96, ...), one or more super-blocks
    k = 256 * max(blocks_of_256, 1) if block_type in SUPER_BLOCKS else 256 * blocks_of_256 + 32 * blocks_of_32 or 32
    blocks, w = matrix(block_type, outputs, k, seed)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * scale
    bias = torch.randn(outputs, generator=torch.Generator().manual_seed(seed + 1))
    rounded = reference_activations(x, block_type)
    expected = rounded @ w.t() + bias.double()
    bound = block_ops.product_bound(rounded, w, k, block_type) + 4 * torch.finfo(torch.float32).eps * bias.double().abs()
    generic = run(x, blocks, block_type, "generic", bias).double()
    assert bool(((generic - expected).abs() <= bound).all())
    results = {variant: run(x, blocks, block_type, variant, bias) for variant in variants()}
    for variant, got in results.items():
        assert bool(((got.double() - expected).abs() <= bound).all()), variant
        assert bool(((got.double() - generic).abs() <= 2 * bound).all()), variant
    if "avx512" in results:  # the same kernels (block_x86.h): vpdpbusd sums what vpmaddubsw + vpmaddwd sum
        assert torch.equal(results["avx512"], results["avx2"])


@pytest.mark.parametrize(("rows", "k"), ((1, 768), (70, 768), (150, 8192)))
@pytest.mark.parametrize("block_type", sorted(GENERIC_ORDER, key=int), ids=lambda t: t.name)
def test_these_types_products_are_the_generic_references_bits(block_type: Q, rows: int, k: int) -> None:
    """A grid type's or Q2_K's / Q3_K's super-block sums are exact integers, and every variant adds
    each one's share with the generic reference's float operations (block_grid_x86.h's grid_term,
    block_k2_x86.h's dot_k2): one row, a prompt's tiles (AVX-512's sixteen rows a register, a
    ragged last group of 6 rows), and a long prompt's several bands all give the generic bits."""
    blocks, _ = matrix(block_type, 19, k, 14)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(15)) * 3
    generic = run(x, blocks, block_type, "generic")
    for variant in variants():
        assert torch.equal(run(x, blocks, block_type, variant), generic), variant


@pytest.mark.parametrize("block_type", TYPES, ids=lambda t: t.name)
def test_a_row_gets_the_same_bits_whatever_rows_are_beside_it(block_type: Q) -> None:
    blocks, _ = matrix(block_type, 40, 512, 1)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    for variant in variants():
        together = run(x, blocks, block_type, variant)
        alone = torch.cat([run(x[i : i + 1], blocks, block_type, variant) for i in range(5)])
        assert torch.equal(together, alone), variant


@pytest.mark.parametrize("rows", (65, 67, 70, 71))
@pytest.mark.parametrize("block_type", TYPES, ids=lambda t: t.name)
def test_a_prefills_tiles_give_every_row_the_bits_it_gets_alone(block_type: Q, rows: int) -> None:
    """Many rows run in tiles of a band of rows by several outputs (block_format.h's Tile: bands
    of 64 rows, AVX-512's in groups of 16, register blocks of 4 or 4 pairs of rows), the outputs
    past the last whole tile by the one-row kernels: every output, bias included, is the same
    bits as its row's product alone, in every variant (65, 67, 70, 71 rows: a second, ragged
    band of 1, 3, 6, 7 rows; K: an odd number of 32-blocks, several super-blocks)."""
    k = 768 if block_type in SUPER_BLOCKS else 800
    blocks, w = matrix(block_type, 19, k, 6)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)) * 3
    bias = torch.randn(19, generator=torch.Generator().manual_seed(8))
    rounded = reference_activations(x, block_type)
    expected = rounded @ w.t() + bias.double()
    bound = block_ops.product_bound(rounded, w, k, block_type) + 4 * torch.finfo(torch.float32).eps * bias.double().abs()
    for variant in variants():
        together = run(x, blocks, block_type, variant, bias)
        alone = torch.cat([run(x[i : i + 1], blocks, block_type, variant, bias) for i in range(rows)])
        assert torch.equal(together, alone), variant
        assert bool(((together.double() - expected).abs() <= bound).all()), variant


def assert_each_row_alone_and_near_the_product(block_type: Q, *, outputs: int, k: int, rows: int,
                                               seeds: tuple[int, int]) -> None:
    """Every variant: `rows` rows of x together give each row the bits it gets alone, and the
    product is within its bound of the dequantized weights times the rounded activations."""
    blocks, w = matrix(block_type, outputs, k, seeds[0])
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seeds[1]))
    rounded = reference_activations(x, block_type)
    bound = block_ops.product_bound(rounded, w, k, block_type)
    for variant in variants():
        together = run(x, blocks, block_type, variant)
        alone = torch.cat([run(x[i : i + 1], blocks, block_type, variant) for i in range(rows)])
        assert torch.equal(together, alone), variant
        assert bool(((together.double() - rounded @ w.t()).abs() <= bound).all()), variant


@pytest.mark.parametrize("block_type", sorted(SUPER_BLOCKS), ids=lambda t: t.name)
def test_a_long_rows_tiles_give_every_row_the_bits_it_gets_alone(block_type: Q) -> None:
    """K of nine super-blocks: past the eight a tile may unpack at once (AVX-512's Q6_K tile
    takes them in chunks), each output still the bits of its row alone and near the exact product."""
    assert_each_row_alone_and_near_the_product(block_type, outputs=8, k=9 * 256, rows=6, seeds=(9, 10))


@pytest.mark.parametrize("block_type", TYPES, ids=lambda t: t.name)
def test_a_long_prompts_row_groups_give_every_row_the_bits_it_gets_alone(block_type: Q) -> None:
    """K = 8192 and 150 rows: a product takes a long prompt's rows in groups (64 float32 rows, 128
    rounded ones here: block_products.cpp's row_group_rows), and a float tile's bands shrink to 16
    rows at this K (float_band_rows, the rows' chunked copy both x86 variants read): every output is
    still the bits of its row alone and near the exact product."""
    assert_each_row_alone_and_near_the_product(block_type, outputs=9, k=8192, rows=150, seeds=(12, 13))


@pytest.mark.parametrize("block_type", TYPES, ids=lambda t: t.name)
def test_an_output_gets_the_same_bits_whatever_rows_of_blocks_are_beside_it(block_type: Q) -> None:
    """The kernels that multiply four rows of blocks at once (block_x86.h's rows32) run each row's
    own operations: a matrix's outputs equal each row's product alone, bit for bit."""
    blocks, _ = matrix(block_type, 11, 512, 4)  # two groups of four and three left over
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(5))
    for variant in variants():
        whole = run(x, blocks, block_type, variant)
        alone = torch.cat([run(x, blocks[n : n + 1].contiguous(), block_type, variant) for n in range(11)], dim=1)
        assert torch.equal(whole, alone), variant


def test_a_zero_group_of_activations_rounds_to_zero() -> None:
    blocks, w = matrix(Q.Q4_K, 4, 512, 3)
    x = torch.zeros(1, 512)
    x[0, 40] = 1.0  # one nonzero input: the other super-block's step is 0
    for variant in variants():
        assert torch.allclose(run(x, blocks, Q.Q4_K, variant).double(), numpy_rounded(x, 256) @ w.t(), rtol=1e-6, atol=1e-7)
        assert torch.equal(run(torch.zeros(2, 512), blocks, Q.Q4_K, variant), torch.zeros(2, 4))


def test_bad_arguments_are_refused_by_name() -> None:
    blocks, _ = matrix(Q.Q4_K, 2, 256, seed=0)
    with pytest.raises(RuntimeError, match="blocks must be contiguous uint8"):
        block_ops.block_linear(torch.randn(1, 512), blocks, Q.Q4_K)  # K of another matrix
    with pytest.raises(RuntimeError, match="not a GGUF block type"):
        torch.ops.qkv.block_linear.default(torch.randn(1, 256), blocks, 9, None)  # Q8_1
    with pytest.raises(RuntimeError, match="K must be whole blocks"):
        block_ops.block_linear(torch.randn(1, 128), blocks[:, :72].contiguous(), Q.Q4_K)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32"):
        block_ops.block_linear(torch.randn(1, 256).double(), blocks, Q.Q4_K)
    with pytest.raises(RuntimeError, match="bias must be"):
        block_ops.block_linear(torch.randn(1, 256), blocks, Q.Q4_K, torch.zeros(3))
    with pytest.raises(RuntimeError, match="block_decode: blocks must be"):
        block_ops.block_decode(blocks, Q.Q4_K, 512)


def test_the_self_test_passes() -> None:
    assert block_ops.block_products_status() is None
