"""Asymmetric integer quantization of cache tensors, and bit packing.

    codes, scale, zero = quantize(x, bits, dim)      # x ~= codes * scale + zero
    x_hat = dequantize(codes, scale, zero)
    packed = pack(codes, bits); codes = unpack(packed, bits, size)

`dim` is the axis the statistics run over: the tokens of a group for keys quantized per
channel (KIVI), the channels of a token for values (and for the per-token key ablation).
Each (min, max) range is split into 2**bits - 1 steps, so a value is off by at most half a
step: |x - x_hat| <= scale / 2 (plus float rounding). `pack` stores 8 // bits codes per
byte along the last axis, so 4-bit codes take half a byte and 2-bit codes a quarter.

Shape legend: any leading axes; the last axis N of codes must be a multiple of 8 // bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

BITS = (2, 4, 8)


def check_bits(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"quantized caches store 2, 4 or 8 bits per number, got {bits}")
    return bits


def quantize(x: Tensor, bits: int, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """-> codes (uint8, shape of x), scale and zero (x's dtype, size 1 along `dim`)."""
    levels = (1 << check_bits(bits)) - 1
    xf = x.float()
    low = xf.amin(dim=dim, keepdim=True)
    high = xf.amax(dim=dim, keepdim=True)
    scale = (high - low) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant range: codes 0
    codes = torch.round((xf - low) / safe).clamp_(0, levels).to(torch.uint8)
    return codes, scale.to(x.dtype), low.to(x.dtype)


def dequantize(codes: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    return (codes.float() * scale.float() + zero.float()).to(scale.dtype)


def pack(codes: Tensor, bits: int) -> Tensor:
    """(..., N) uint8 codes < 2**bits -> (..., N * bits // 8) bytes."""
    per = 8 // check_bits(bits)
    if codes.shape[-1] % per:
        raise ValueError(f"cannot pack {codes.shape[-1]} codes of {bits} bits into whole bytes")
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per).to(torch.int32)  # (..., N/per, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits  # (per,)
    return (grouped << shifts).sum(dim=-1).to(torch.uint8)  # (..., N/per)


def unpack(packed: Tensor, bits: int) -> Tensor:
    """(..., M) bytes -> (..., M * 8 // bits) uint8 codes."""
    per = 8 // check_bits(bits)
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits  # (per,)
    codes = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)  # (..., M, per)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per).to(torch.uint8)
