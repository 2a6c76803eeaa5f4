"""GGUF's K-quants (Q2_K .. Q6_K), IQ4_NL and IQ4_XS dequantized with torch operations on the block bytes.

These are the types of the files people download (a Q4_K_M file is Q4_K and Q6_K matrices,
some Q5_0/Q8_0, F32 norms). Each decoder below follows the `gguf` library's numpy code
operation for operation in float32 (`(d * sc) * q - dmin * m`, no fused multiply-add), so
the values are bit-identical to `gguf.quants.dequantize` (tests/models/gguf/test_dequantize.py).

Super-block layouts (little-endian, 256 weights a block unless said; "sub" = a group of
weights sharing one scale):

    Q2_K  (84 bytes)  scales[16] (low nibble: scale, high: min), qs[64] 2-bit, d f16, dmin f16
                      16 subs of 16: x = (d * sc) * q - dmin * m
    Q3_K (110 bytes)  hmask[32], qs[64] 2-bit, scales[12] 6-bit signed (-32), d f16
                      16 subs of 16: x = (d * sc) * (q_low - 4 * (1 - hbit))
    Q4_K (144 bytes)  d f16, dmin f16, scales[12] (8 x 6-bit scale, 8 x 6-bit min), qs[128]
                      8 subs of 32: x = (d * sc) * q - dmin * m, q in 0..15
    Q5_K (176 bytes)  d, dmin, scales[12] as Q4_K, qh[32] (fifth bits), qs[128]
    Q6_K (210 bytes)  ql[128] low nibbles, qh[64] high 2 bits, scales[16] int8, d f16
                      16 subs of 16: x = (d * sc) * (q - 32), q in 0..63
    IQ4_NL (18 bytes) d f16, qs[16]; 32 weights: x = d * KVALUES[nibble]
    IQ4_XS (136 bytes) d f16, scales_h u16, scales_l[4], qs[128]; 8 subs of 32, each with a
                      6-bit scale (low 4 bits: nibble s % 2 of scales_l[s // 2], high 2: bits
                      2s of scales_h): x = (d * (sc - 32)) * KVALUES[nibble], the nibbles of
                      a sub as IQ4_NL's (16 bytes: low nibbles first, then the high ones)

Bit positions, for weight w of a block (as the gguf library reshapes them):
    Q2_K/Q3_K 2-bit q: byte (w // 128) * 32 + w % 32 of qs, shift 2 * ((w // 32) % 4)
    Q3_K high bit: bit (w // 32) of hmask[w % 32]
    Q4_K/Q5_K nibble: byte (w // 64) * 32 + w % 32, high nibble for odd (w // 32)
    Q5_K fifth bit: bit (w // 32) of qh[w % 32]
    Q6_K low nibble: ql byte (w // 128) * 64 + w % 64, high nibble when (w // 64) % 2;
         high 2 bits: qh byte (w // 128) * 32 + w % 32, shift 2 * ((w // 32) % 4)

Shape legend: B blocks; every decoder takes (B, bytes) uint8 and returns (B, weights) float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

QK_K = 256  # weights per K-quant super-block
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def f16_at(blocks: Tensor, start: int) -> Tensor:
    """The float16 at byte `start` of every block, as float32: (B, bytes) -> (B, 1)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _shifted(packed: Tensor, groups: int, shifts: tuple[int, ...]) -> Tensor:
    """(B, groups * n) bytes -> (B, groups, len(shifts), n) bytes shifted right: the gguf
    library's `reshape((B, -1, 1, n)) >> shifts` that spreads packed bits over weights."""
    b = packed.shape[0]
    by = torch.tensor(shifts, dtype=torch.uint8).reshape(1, 1, -1, 1)
    return packed.reshape(b, groups, 1, -1) >> by  # (B, groups, shifts, n)


def scale_min_k4(scales: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K/Q5_K's 12 scale bytes -> (scales, minimums), each (B, 8) uint8 of 6 bits."""
    b = scales.shape[0]
    s = scales.reshape(b, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]  # (B, 4) each
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def q2_k(blocks: Tensor) -> Tensor:
    b = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = f16_at(blocks, 80), f16_at(blocks, 82)
    dl = (d * (scales & 0xF).float()).reshape(b, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(b, 16, 1)
    q = (_shifted(qs, 2, (0, 2, 4, 6)) & 3).reshape(b, 16, 16).float()
    return (dl * q - ml).reshape(b, QK_K)


def q3_k(blocks: Tensor) -> Tensor:
    b = blocks.shape[0]
    hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    d = f16_at(blocks, 108)
    low = _shifted(scales[:, :8], 1, (0, 4)).reshape(b, 16)
    high = _shifted(scales[:, 8:12], 1, (0, 2, 4, 6)).reshape(b, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).view(torch.int8) - 32  # 0..63 fits int8 before the offset
    dl = (d * sc.float()).reshape(b, 16, 1)
    ql = _shifted(qs, 2, (0, 2, 4, 6)).reshape(b, 16, 16) & 3
    qh = (_shifted(hmask, 1, tuple(range(8))).reshape(b, 16, 16) & 1) ^ 1  # the offset applies when the bit is 0
    q = (ql.view(torch.int8) - (qh << 2).view(torch.int8)).float()
    return (dl * q).reshape(b, QK_K)


def _k4_scales(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """(d * sc, dmin * m) of Q4_K/Q5_K, each (B, 8, 1) float32."""
    b = blocks.shape[0]
    d, dmin = f16_at(blocks, 0), f16_at(blocks, 2)
    sc, mn = scale_min_k4(blocks[:, 4:16])
    return (d * sc.float()).reshape(b, 8, 1), (dmin * mn.float()).reshape(b, 8, 1)


def q4_k(blocks: Tensor) -> Tensor:
    b = blocks.shape[0]
    dl, ml = _k4_scales(blocks)
    q = (_shifted(blocks[:, 16:144], 4, (0, 4)) & 0x0F).reshape(b, 8, 32).float()
    return (dl * q - ml).reshape(b, QK_K)


def q5_k(blocks: Tensor) -> Tensor:
    b = blocks.shape[0]
    dl, ml = _k4_scales(blocks)
    ql = _shifted(blocks[:, 48:176], 4, (0, 4)).reshape(b, 8, 32) & 0x0F
    qh = _shifted(blocks[:, 16:48], 1, tuple(range(8))).reshape(b, 8, 32) & 1
    q = (ql | (qh << 4)).float()
    return (dl * q - ml).reshape(b, QK_K)


def q6_k(blocks: Tensor) -> Tensor:
    b = blocks.shape[0]
    ql, qh, scales = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208]
    d = f16_at(blocks, 208)
    dl = (d * scales.contiguous().view(torch.int8).float()).reshape(b, 16, 1)
    low = _shifted(ql, 2, (0, 4)).reshape(b, 8, 32) & 0x0F
    high = _shifted(qh, 2, (0, 2, 4, 6)).reshape(b, 8, 32) & 0x03
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(b, 16, 16).float()
    return (dl * q).reshape(b, QK_K)


def iq4_nl(blocks: Tensor) -> Tensor:
    b = blocks.shape[0]
    d = f16_at(blocks, 0)
    index = (_shifted(blocks[:, 2:18], 1, (0, 4)) & 0x0F).reshape(b, 32).long()
    values = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)[index]  # (B, 32)
    return d * values


def iq4_xs(blocks: Tensor) -> Tensor:
    b = blocks.shape[0]
    d = f16_at(blocks, 0)
    scales_h = blocks[:, 2:4].contiguous().view(torch.int16).int() & 0xFFFF  # (B, 1)
    low = (_shifted(blocks[:, 4:8], 4, (0, 4)).reshape(b, 8) & 0x0F).int()  # sub s: nibble s % 2 of byte s // 2
    high = (scales_h >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3  # (B, 8)
    dl = (d * ((low | (high << 4)) - 32).float()).reshape(b, 8, 1)
    index = (_shifted(blocks[:, 8:136], 8, (0, 4)) & 0x0F).reshape(b, 8, 32).long()
    values = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)[index]  # (B, 8, 32)
    return (dl * values).reshape(b, QK_K)
