"""GGUF tensors dequantized with torch operations on their raw block bytes.

Why not `gguf.quants.dequantize` for every tensor: it walks the tensor in numpy, a group of
rows at a time, and took about 1.2 s of SmolLM2-135M's (Q4_1) start-up on a 2-core CPU.
The formats that matter for small llama.cpp files are simple: a block of 32 weights is a
float16 scale (and, for the "_1" types, a float16 minimum) followed by packed integers. Here
each format is a handful of whole-tensor torch operations. The arithmetic is the gguf
library's, operation for operation in float32 (`d * q`, then `+ m`; no fused multiply-add),
so the values are bit-identical to its output (tests/models/gguf/test_dequantize.py checks it
on the SmolLM2 file and on random blocks of every type here).

The K-quants (Q2_K .. Q6_K), IQ4_NL and IQ4_XS are decoded the same way in `qkv.models.gguf.kquants`.
The grid types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) are block formats here
too, so their files stay in their blocks, but a whole-tensor decode of them is the gguf
library's own. Types outside BLOCK_FORMATS (the ternary TQ types, ...) go through the gguf
library, one tensor at a time, in `qkv.models.gguf.checkpoint.dequantize`: TYPES lists the
ones decoded here.

Block layouts (little-endian; B blocks of 32 weights, one row of bytes each; the K-quants'
layouts are in gguf_kquants):

    F32                plain values (not a block type: no kernel multiplies it as stored)
    F16 / BF16 (64)    32 plain 16-bit values, a "block" only in that qkv's block products
                       (qkv.runtime.native.block_ops) take them 32 at a time
    Q8_0  (34 bytes)   d: f16, q: 32 x int8                          x = d * q
    Q4_0  (18 bytes)   d: f16, 16 bytes of nibbles                   x = d * (q - 8)
    Q4_1  (20 bytes)   d: f16, m: f16, 16 bytes of nibbles           x = d * q + m
    Q5_0  (22 bytes)   d: f16, qh: u32 (fifth bits), 16 nibble bytes x = d * (q - 16)
    Q5_1  (24 bytes)   d: f16, m: f16, qh: u32, 16 nibble bytes      x = d * q + m

A nibble byte j holds weight j in its low four bits and weight j + 16 in its high four; bit
i of qh is the fifth (high) bit of weight i.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q
from torch import Tensor

from qkv.models.gguf import kquants as kq

BLOCK = 32  # weights per block of the 32-weight formats below


def _f16(blocks: Tensor, start: int) -> Tensor:
    """The float16 at byte `start` of every block, as float32: (B, 20-ish bytes) -> (B, 1)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: Tensor, high: Tensor | None = None) -> Tensor:
    """(B, 16) bytes -> (B, 32) float32 values 0..15 (0..31 with `high`, (B, 32) fifth bits).

    Low nibbles are weights 0-15, high ones 16-31. The halves are written straight into
    the float32 result: a fresh (B, 32) integer tensor would cost as much again in page
    faults as the conversion itself (measured: 0.28 s per 128M weights, for each one).
    """
    out = torch.empty(packed.shape[0], BLOCK, dtype=torch.float32)  # (B, 32)
    half = BLOCK // 2
    if high is None:
        out[:, :half] = packed & 0x0F
        out[:, half:] = packed >> 4
    else:
        out[:, :half] = (packed & 0x0F) | high[:, :half]
        out[:, half:] = (packed >> 4) | high[:, half:]
    return out


def _fifth_bits(blocks: Tensor, start: int) -> Tensor:
    """The u32 at byte `start` of every block, bit i -> 16 for weight i: (B, n) -> (B, 32) uint8."""
    # a copy, not .contiguous(): one block's slice is contiguous already, at an offset of 2 bytes
    qh = blocks[:, start : start + 4].clone(memory_format=torch.contiguous_format).view(torch.int32)  # (B, 1); sign is masked off below
    shifts = torch.arange(BLOCK, dtype=torch.int32)
    return (((qh >> shifts) & 1) << 4).to(torch.uint8)  # (B, 32)


# gguf subtracts the offset in int8 and then converts to float32; on 0..31 integers the
# float32 subtraction used here is exact, so the values are the same.


def _q8_0(blocks: Tensor) -> Tensor:
    d = _f16(blocks, 0)
    q = torch.empty(blocks.shape[0], BLOCK, dtype=torch.float32)
    q.copy_(blocks[:, 2:].contiguous().view(torch.int8))  # (B, 32) int8 -> float32
    return q.mul_(d)  # x * d: one rounding, as gguf's


def _q4_0(blocks: Tensor) -> Tensor:
    d = _f16(blocks, 0)
    return _nibbles(blocks[:, 2:]).sub_(8).mul_(d)


def _q4_1(blocks: Tensor) -> Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return _nibbles(blocks[:, 4:]).mul_(d).add_(m)  # (d * q) + m: the same two roundings as gguf's


def _q5_0(blocks: Tensor) -> Tensor:
    d = _f16(blocks, 0)
    return _nibbles(blocks[:, 6:], _fifth_bits(blocks, 2)).sub_(16).mul_(d)


def _q5_1(blocks: Tensor) -> Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return _nibbles(blocks[:, 8:], _fifth_bits(blocks, 4)).mul_(d).add_(m)


def _gguf_decode(block_type: Q) -> Callable[[Tensor], Tensor]:
    """The gguf library's own decode of a grid type (IQ1_S, IQ2_*, IQ3_*): (B, size) uint8 ->
    (B, 256) float32. These files are kept in their blocks (the `blocks` precision), so a whole
    tensor is decoded only where another precision asks for it; one numpy pass is fine there."""
    def decode(blocks: Tensor) -> Tensor:
        values = gguf_quants.dequantize(blocks.contiguous().numpy(), block_type)  # (B, 256) float32
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return decode


def _plain(dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    """The decode of 16-bit plain values: (B, 64) uint8 -> (B, 32) float32, each value widened exactly."""
    def decode(blocks: Tensor) -> Tensor:
        return blocks.contiguous().view(dtype).float()
    return decode


@dataclass(frozen=True)
class BlockFormat:
    """How one GGUF block type is stored and decoded."""

    weights: int  # weights per block
    size: int  # bytes per block
    decode: Callable[[Tensor], Tensor]  # (B, size) uint8 -> (B, weights) float32
    halves: tuple[int, ...]  # byte offsets of the block's float16 scales (and minimums)
    values: torch.dtype | None = None  # F16 / BF16: the weights are plain values of this type, no scales
    # a float16 scale stored in pieces (IQ1_M's: Iq1mScale), read for the finiteness check
    # (qkv.models.gguf.scales) and written by the block products' self-test
    split_scale: type[Iq1mScale] | None = None


class Iq1mScale:
    """IQ1_M's float16 d, stored in pieces: the top nibble of each of its four uint16 scale
    words (bytes 48..55), lowest nibble first."""

    @staticmethod
    def read(blocks: np.ndarray) -> np.ndarray:
        """(B, 56) uint8 -> (B,) the bits of d, uint16."""
        words = np.ascontiguousarray(blocks[:, 48:56]).view("<u2")  # (B, 4)
        return ((words[:, 0] >> 12) | ((words[:, 1] >> 8) & 0x00F0) | ((words[:, 2] >> 4) & 0x0F00)
                | (words[:, 3] & 0xF000)).astype(np.uint16)

    @staticmethod
    def write(blocks: np.ndarray, bits: np.ndarray) -> None:
        """Set d of each (B, 56) uint8 block to the (B,) uint16 `bits`, in place."""
        words = np.ascontiguousarray(blocks[:, 48:56]).view("<u2") & 0x0FFF  # (B, 4)
        for j in range(4):
            words[:, j] |= ((bits.astype(np.uint16) >> (4 * j)) & 0xF) << 12
        blocks[:, 48:56] = words.view(np.uint8)


def _format(block_type: Q, decode: Callable[[Tensor], Tensor], halves: tuple[int, ...]) -> BlockFormat:
    """A block type's format, its sizes from the gguf package's GGML_QUANT_SIZES (the one table
    of them on the Python side; runtime/native/csrc/block_format.cpp is the C++ one, and a test
    holds the two together)."""
    weights, size = GGML_QUANT_SIZES[block_type]
    return BlockFormat(weights, size, decode, halves)


BLOCK_FORMATS: dict[Q, BlockFormat] = {
    Q.Q8_0: _format(Q.Q8_0, _q8_0, (0,)),
    Q.Q4_0: _format(Q.Q4_0, _q4_0, (0,)),
    Q.Q4_1: _format(Q.Q4_1, _q4_1, (0, 2)),
    Q.Q5_0: _format(Q.Q5_0, _q5_0, (0,)),
    Q.Q5_1: _format(Q.Q5_1, _q5_1, (0, 2)),
    Q.Q2_K: _format(Q.Q2_K, kq.q2_k, (80, 82)),
    Q.Q3_K: _format(Q.Q3_K, kq.q3_k, (108,)),
    Q.Q4_K: _format(Q.Q4_K, kq.q4_k, (0, 2)),
    Q.Q5_K: _format(Q.Q5_K, kq.q5_k, (0, 2)),
    Q.Q6_K: _format(Q.Q6_K, kq.q6_k, (208,)),
    Q.IQ4_NL: _format(Q.IQ4_NL, kq.iq4_nl, (0,)),
    Q.IQ4_XS: _format(Q.IQ4_XS, kq.iq4_xs, (0,)),
    # the grid types: a float16 d first, then grid indices, signs and small integer scales
    **{t: _format(t, _gguf_decode(t), (0,)) for t in (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S)},
    Q.IQ1_M: BlockFormat(*GGML_QUANT_SIZES[Q.IQ1_M], _gguf_decode(Q.IQ1_M), (), split_scale=Iq1mScale),
    # gguf's sizes for these are (1, 2), one value a "block"; the products take them 32 at a time
    # (runtime/native/csrc/block_format.h's FLOAT_BLOCK), so a row must be whole 32s of them
    Q.F16: BlockFormat(BLOCK, 2 * BLOCK, _plain(torch.float16), (), torch.float16),
    Q.BF16: BlockFormat(BLOCK, 2 * BLOCK, _plain(torch.bfloat16), (), torch.bfloat16),
}
PLAIN = {Q.F32: torch.float32}  # the plain type that is no block type


TYPES = frozenset(PLAIN) | frozenset(BLOCK_FORMATS)


def whole_blocks(tensor_type: Q, row: int) -> bool:
    """Whether a matrix of `tensor_type` with rows of `row` values is whole blocks of a block type
    (always so for a quantized type as a file stores it; F16 / BF16 rows must be whole 32s)."""
    form = BLOCK_FORMATS.get(tensor_type)
    return form is not None and row % form.weights == 0


def plain_dtype(tensor_type: Q) -> torch.dtype | None:
    """The torch dtype of a plain-valued type (F32, F16, BF16), None for a quantized one."""
    form = BLOCK_FORMATS.get(tensor_type)
    return PLAIN.get(tensor_type) if form is None else form.values


def dequantize_blocks(parts: list[np.ndarray], tensor_type: Q) -> Tensor:
    """The weights of `parts` (raw bytes of whole blocks, any shape, all of `tensor_type`),
    one after the other, as one flat float32 tensor.

    Tensors of one type are decoded together so that each step is one large operation
    rather than one per tensor: on a loaded 2-core machine every multi-threaded torch
    operation waited milliseconds for its second thread, and SmolLM2 has 210 Q4_1 tensors.
    The bytes are copied once, into memory PyTorch owns (the file's map is read-only).
    A type not in TYPES -> KeyError; a byte count that is not whole blocks -> ValueError.
    """
    raw = torch.from_numpy(np.concatenate([part.reshape(-1).view(np.uint8) for part in parts]))  # (bytes,)
    dtype = plain_dtype(tensor_type)
    if dtype is not None:  # any count of values, not only whole blocks of 32 (a norm's 1-D tensor)
        if raw.numel() % dtype.itemsize:
            raise ValueError(f"{raw.numel()} bytes are not whole {tensor_type.name} values")
        return raw.view(dtype).float()
    block = BLOCK_FORMATS[tensor_type]
    if raw.numel() % block.size:
        raise ValueError(f"{raw.numel()} bytes are not whole {tensor_type.name} blocks of {block.size} bytes")
    return block.decode(raw.view(-1, block.size)).reshape(-1)  # (B, bytes) -> (B, weights) -> (B * weights,)
