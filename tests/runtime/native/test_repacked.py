"""Q4_K, Q5_K, Q8_0, Q5_0, IQ4_XS and Q6_K repacked into qkv's Q4_K_X16 / Q5_K_X16 / Q8_0_X16 /
Q5_0_X16 / IQ4_XS_X16 / Q6_K_X16 layouts (qkv.runtime.native.repacked, csrc/repacked/): the repacking is the documented byte
permutation, undoing it gives the file's bytes back, and its product is the gguf library's
dequantized weights times the rounded activations (float64, within the float bound the block
products are held to), the same bits in every variant and for each row whatever the other
rows, as the server's batches need; Q8_0_X16's, Q5_0_X16's, IQ4_XS_X16's and Q6_K_X16's are the
generic C++ product's bits on the file's rows."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from qkv.models.gguf.stored import StoredBlocks
from qkv.runtime.linear.block import BlockLinear
from qkv.runtime.native import block_ops, repacked
from qkv.runtime.native.ops import use_variant, variants
from tests.models.gguf.block_files import random_blocks
from tests.runtime.native.test_block_products import numpy_rounded

pytestmark = pytest.mark.skipif(repacked.repack_status() is not None, reason="qkv's repacked K-quant products do not build here")
TYPES = [Q.Q4_K, Q.Q5_K, Q.Q8_0, Q.Q5_0, Q.IQ4_XS, Q.Q6_K]
SAME_AS_STORED = (Q.Q8_0, Q.Q5_0, Q.IQ4_XS, Q.Q6_K)  # the generic stored product's operations, lane by lane


def k_rows(block_type: Q, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows (N, K / W * Z) uint8 and the gguf library's weights (N, K) float64."""
    raw = np.ascontiguousarray(random_blocks(block_type, (n, k), np.random.default_rng(seed)))
    return torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, block_type)).reshape(n, k).double()


def numpy_layout(block_type: Q, rows: np.ndarray) -> np.ndarray:
    if block_type == Q.Q8_0:
        return numpy_q8_0_layout(rows)
    if block_type == Q.Q5_0:
        return numpy_q5_0_layout(rows)
    if block_type == Q.IQ4_XS:
        return numpy_iq4_xs_layout(rows)
    if block_type == Q.Q6_K:
        return numpy_q6_k_layout(rows)
    return numpy_k4_layout(rows, block_type)


def numpy_q8_0_layout(rows: np.ndarray) -> np.ndarray:
    """q8_0.h's layout written out in numpy: per group of 16 rows, every block's d of the 16
    rows, then every block's qs in 4-byte units of 16 rows."""
    n, row_bytes = rows.shape
    count = row_bytes // 34
    blocks = rows.reshape(n // 16, 16, count, 34).transpose(0, 2, 1, 3)  # (groups, blocks, 16, 34)
    d = blocks[..., 0:2].reshape(n // 16, -1)  # (groups, blocks * 16 * 2)
    qs = blocks[..., 2:].reshape(n // 16, count, 16, 8, 4).transpose(0, 1, 3, 2, 4).reshape(n // 16, -1)  # (groups, blocks * 8 * 16 * 4)
    return np.concatenate([d, qs], axis=-1).reshape(n, row_bytes)


def numpy_q5_0_layout(rows: np.ndarray) -> np.ndarray:
    """q8_0.h's Q5_0 layout written out in numpy: per group of 16 rows, every block's d of the
    16 rows, then per block the 16 rows' qh (4 bytes each) and qs in 4-byte units of 16 rows."""
    n, row_bytes = rows.shape
    count = row_bytes // 22
    blocks = rows.reshape(n // 16, 16, count, 22).transpose(0, 2, 1, 3)  # (groups, blocks, 16, 22)
    d = blocks[..., 0:2].reshape(n // 16, -1)  # (groups, blocks * 16 * 2)
    qh = blocks[..., 2:6]  # (groups, blocks, 16, 4)
    qs = blocks[..., 6:].reshape(n // 16, count, 16, 4, 4).transpose(0, 1, 3, 2, 4)  # (groups, blocks, 4 units, 16, 4)
    body = np.concatenate([qh.reshape(n // 16, count, -1), qs.reshape(n // 16, count, -1)], axis=-1)  # (groups, blocks, 320)
    return np.concatenate([d, body.reshape(n // 16, -1)], axis=-1).reshape(n, row_bytes)


def numpy_iq4_xs_layout(rows: np.ndarray) -> np.ndarray:
    """iq4xs.h's layout written out in numpy: per group of 16 rows and super-block, d, scales_h
    and scales_l of the 16 rows side by side, then qs in 4-byte units of 16 rows."""
    n, row_bytes = rows.shape
    supers = row_bytes // 136
    blocks = rows.reshape(n // 16, 16, supers, 136).transpose(0, 2, 1, 3)  # (groups, supers, 16, 136)
    qs = blocks[..., 8:].reshape(n // 16, supers, 16, 32, 4).transpose(0, 1, 3, 2, 4)  # (groups, supers, 32 units, 16, 4)
    parts = [blocks[..., a:b].reshape(n // 16, supers, -1) for a, b in ((0, 2), (2, 4), (4, 8))]
    parts.append(qs.reshape(n // 16, supers, -1))
    return np.concatenate(parts, axis=-1).reshape(n, row_bytes)


def numpy_q6_k_layout(rows: np.ndarray) -> np.ndarray:
    """q6k.h's layout written out in numpy: per group of 16 rows and super-block, the rows' d,
    then each sub-block's scale of the 16 rows, then 16 chunks c = 8 h + 4 q + s of three 4-byte
    units of 16 rows: ql unit 16 h + 4 q + s, ql unit 16 h + 8 + 4 q + s, qh unit c."""
    n, row_bytes = rows.shape
    g, supers = n // 16, row_bytes // 210
    blocks = rows.reshape(g, 16, supers, 210).transpose(0, 2, 1, 3)  # (groups, supers, 16, 210)

    def units(part: np.ndarray) -> np.ndarray:  # (groups, supers, 16, 4 u) -> (groups, supers, u * 16 * 4)
        return part.reshape(g, supers, 16, -1, 4).transpose(0, 1, 3, 2, 4).reshape(g, supers, -1)

    d = blocks[..., 208:210].reshape(g, supers, -1)
    scales = blocks[..., 192:208].transpose(0, 1, 3, 2).reshape(g, supers, -1)  # (16 rows, 16 j) -> (16 j, 16 rows)
    ql, qh = units(blocks[..., :128]), units(blocks[..., 128:192])  # (groups, supers, 32 u * 64), (.., 16 v * 64)
    unit = lambda part, u: part[..., 64 * u : 64 * (u + 1)]  # noqa: E731
    chunks = [np.concatenate([unit(ql, 16 * h + 4 * q + s), unit(ql, 16 * h + 8 + 4 * q + s), unit(qh, 8 * h + 4 * q + s)], axis=-1)
              for h in range(2) for q in range(2) for s in range(4)]  # c = 8 h + 4 q + s
    return np.concatenate([d, scales, *chunks], axis=-1).reshape(n, row_bytes)


def rounded(x: torch.Tensor, block_type: Q) -> torch.Tensor:
    """x rounded as `block_type`'s products meet it (per 32 for Q8_0, per 256 for the K-quants), float64."""
    return numpy_rounded(x, block_ops.activation_step(block_type))


def numpy_k4_layout(rows: np.ndarray, block_type: Q) -> np.ndarray:
    """q4k.h's layout written out in numpy: per group of 16 rows and super-block, d, dmin, the
    three 4-byte scale words of each row side by side, then qs in 4-byte units of 16 rows
    (Q5_K: then qh in 4-byte units of 16 rows)."""
    n, row_bytes = rows.shape
    size = 176 if block_type == Q.Q5_K else 144
    supers = row_bytes // size
    blocks = rows.reshape(n // 16, 16, supers, size).transpose(0, 2, 1, 3)  # (groups, supers, 16, size)

    def units(part: np.ndarray) -> np.ndarray:  # (groups, supers, 16, 4 u) -> (groups, supers, u * 16 * 4)
        return part.reshape(n // 16, supers, 16, -1, 4).transpose(0, 1, 3, 2, 4).reshape(n // 16, supers, -1)

    parts = [blocks[..., a:b].reshape(n // 16, supers, -1) for a, b in ((0, 2), (2, 4), (4, 8), (8, 12), (12, 16))]
    parts.append(units(blocks[..., size - 128 :]))  # qs
    if block_type == Q.Q5_K:
        parts.append(units(blocks[..., 16:48]))  # qh
    return np.concatenate(parts, axis=-1).reshape(n, row_bytes)


@pytest.mark.parametrize("block_type", TYPES)
def test_the_repacking_is_the_documented_permutation_and_undoes_to_the_files_bytes(block_type: Q) -> None:
    blocks, w = k_rows(block_type, 48, 768, seed=1)
    before = blocks.clone()
    packed = repacked.repack(blocks, block_type)
    assert torch.equal(blocks, before)  # a copy: the file's mapping is never written
    assert torch.equal(packed, torch.from_numpy(numpy_layout(block_type, blocks.numpy())))
    back = repacked.unrepack(packed, block_type)
    assert torch.equal(back, blocks)
    assert torch.equal(block_ops.block_decode(back, block_type, 768).double(), w)  # the file's dequantized values


@pytest.mark.parametrize("block_type", TYPES)
def test_repacking_into_a_slice_writes_the_same_bytes_there_and_nowhere_else(block_type: Q) -> None:
    blocks, _ = k_rows(block_type, 32, 512, seed=10)
    out = torch.full((64, blocks.shape[1]), 3, dtype=torch.uint8)
    assert repacked.repack_into(blocks, block_type, out[16:48]).data_ptr() == out[16:48].data_ptr()
    assert torch.equal(out[16:48], repacked.repack(blocks, block_type))
    assert bool((out[:16] == 3).all()) and bool((out[48:] == 3).all())
    with pytest.raises(RuntimeError, match="one shape"):
        repacked.repack_into(blocks, block_type, out[:16])
    with pytest.raises(RuntimeError, match="not overlapping"):
        repacked.repack_into(blocks, block_type, blocks)


@pytest.mark.parametrize("block_type", TYPES)
@pytest.mark.parametrize("n,k,m", [(16, 256, 1), (48, 768, 5), (32, 512, 7), (32, 2048, 9), (32, 2048, 40), (48, 768, 70)])
def test_the_repacked_product_is_the_dequantized_weights_times_the_rounded_activations(block_type: Q, n: int, k: int, m: int) -> None:
    blocks, w = k_rows(block_type, n, k, seed=n + k)
    packed, code = repacked.repack(blocks, block_type), repacked.REPACKED[block_type]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7))
    x_rounded = rounded(x, block_type)
    expected = x_rounded @ w.t() + bias.double()
    bound = block_ops.product_bound(x_rounded, w, k, block_type) + 1e-6 * bias.double().abs()
    results = {}
    for variant in variants():
        with use_variant(variant):
            results[variant] = block_ops.block_linear(x, packed, code, bias)
        assert ((results[variant].double() - expected).abs() <= bound).all(), variant
    first = results[variants()[0]]
    assert all(torch.equal(first, got) for got in results.values()), "every variant gives the same bits"
    if block_type in SAME_AS_STORED:  # the generic stored product's operations (q8_0.h, iq4xs.h, q6k.h), on the file's rows
        with use_variant("generic"):
            assert torch.equal(first, block_ops.block_linear(x, blocks, block_type, bias))


@pytest.mark.parametrize("block_type", TYPES)
def test_each_row_is_the_same_bits_whatever_the_other_rows(block_type: Q) -> None:
    """Tiles of 4 activation rows (8 in Q6_K's AVX-512 kernel and Q4_K's and Q5_K's unpacked panels, which a pass
    of 16 rows and more takes) and passes of 64: rows alone, in batches of every size, and beside other rows all give
    the same bits, in every variant."""
    blocks, _ = k_rows(block_type, 64, 512, seed=3)
    packed, code = repacked.repack(blocks, block_type), repacked.REPACKED[block_type]
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(70, 512, generator=generator)
    for variant in variants():
        with use_variant(variant):
            whole = block_ops.block_linear(x, packed, code)
            alone = torch.cat([block_ops.block_linear(x[i : i + 1], packed, code) for i in range(0, 70, 7)])
            mixed = block_ops.block_linear(torch.cat([torch.randn(3, 512, generator=generator), x[:6]]), packed, code)
        assert torch.equal(whole[::7], alone), variant
        assert torch.equal(whole[:6], mixed[3:]), variant


@pytest.mark.parametrize("block_type", repacked.AT_LOAD)
def test_block_linear_repacks_in_whole_groups_and_keeps_the_rest_as_stored(block_type: Q) -> None:
    blocks, w = k_rows(block_type, 32, 512, seed=5)
    layer = BlockLinear(StoredBlocks(blocks, block_type, (32, 512)))
    assert layer.repacked and layer.blocks.numel() == blocks.numel()  # the file's size, permuted
    assert torch.equal(layer.stored.blocks, blocks)  # `stored` undoes the repacking
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(6))
    x_rounded = rounded(x, block_type)
    assert ((layer(x).double() - x_rounded @ w.t()).abs() <= block_ops.product_bound(x_rounded, w, 512, block_type)).all()
    odd, _ = k_rows(block_type, 24, 512, seed=6)  # not whole groups of 16: the file's layout
    assert not BlockLinear(StoredBlocks(odd, block_type, (24, 512))).repacked


def test_block_linear_repacks_q6_k_where_the_cpu_runs_the_avx512_kernels() -> None:
    """Q6_K_X16's one-row AVX2 kernel is slower than the stored rows' (repacked.py's WITH_AVX512):
    an AVX2 CPU keeps the file's rows; either way the product is the same."""
    blocks, w = k_rows(Q.Q6_K, 32, 512, seed=11)
    layer = BlockLinear(StoredBlocks(blocks, Q.Q6_K, (32, 512)))
    assert layer.repacked == ("avx512" in variants())
    assert torch.equal(layer.stored.blocks, blocks)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(12))
    with use_variant("generic"):
        assert torch.equal(layer(x), block_ops.block_linear(x, blocks, Q.Q6_K))  # the stored product's bits
    with use_variant("avx2"):  # kernels capped below AVX-512 (an AVX2 CPU's path): loaded as that CPU loads it
        assert not BlockLinear(StoredBlocks(blocks, Q.Q6_K, (32, 512))).repacked


@pytest.mark.parametrize("block_type", TYPES)
def test_the_repacking_refuses_rows_that_are_not_whole_groups(block_type: Q) -> None:
    blocks, _ = k_rows(block_type, 24, 256, seed=8)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        repacked.repack(blocks, block_type)
    whole, _ = k_rows(block_type, 16, 256, seed=9)
    with pytest.raises(RuntimeError, match="not a GGUF block type"):  # no block-by-block decode of the interleaved rows
        block_ops.block_decode(repacked.repack(whole, block_type), repacked.REPACKED[block_type], 256)


@pytest.mark.parametrize("block_type", TYPES)
def test_a_prompt_is_the_same_bits_on_one_thread_and_on_two(block_type: Q) -> None:
    """A 70-row product (rounded activations split over the threads by rows, Q5_K's panels,
    outputs claimed piece by piece by whichever thread is free) gives each output the same
    operations whichever thread computes it: one thread and two give the same bits."""
    blocks, _ = k_rows(block_type, 64, 512, seed=5)
    packed, code = repacked.repack(blocks, block_type), repacked.REPACKED[block_type]
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(6))
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append((block_ops.block_linear(x, packed, code), block_ops.block_linear(x, blocks, block_type)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
