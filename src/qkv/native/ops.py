"""The native ops as Python functions, their fake implementations (what torch.compile
traces), and the 4-bit block layout written out in torch (the reference the kernel is
tested against, and the fallback's dequantization).

4-bit blocks (GGUF's Q4_1 layout): a row of K inputs is K/32 blocks; block g of row n has
16 bytes q[n, 16g:16g+16], where byte j holds element j in its low nibble and element j+16
in its high one, and two float16 numbers d[n, g] and m[n, g]: w = q * d + m, q in 0..15.

Shape legend: M rows of x, K inputs, N outputs, G = K / 32 blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32


def int8_linear(x: Tensor, w: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor:
    """(x @ w^T) * scales + bias: x (M, K) float32, w (N, K) int8, scales (N,) float32."""
    return torch.ops.qkv.int8_linear.default(x, w, scales, bias)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, scale: float) -> Tensor:
    """One query per head over a KV cache: q (B, H, D), k (B, H_kv, S, D), v (B, H_kv, S, D_v)
    float32, visible (B, H, S) bool or None -> (B, H, D_v); zeros where no key is visible."""
    return torch.ops.qkv.decode_attention.default(q, k, v, visible, scale)


def f32_linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ w^T + bias: x (M, K) and w (N, K) float32 (nn.Linear's product)."""
    return torch.ops.qkv.f32_linear.default(x, w, bias)


def int4_linear(x: Tensor, q: Tensor, d: Tensor, m: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ w^T + bias for 4-bit blocks (module docstring), x (M, K) float32 rounded to int8
    per block of 32 inputs inside the kernel; d and m float16, or their bits in int16."""
    return torch.ops.qkv.int4_linear.default(x, q, d, m, bias)


def unpack_blocks(q: Tensor) -> Tensor:
    """(N, K/2) uint8 in the block layout -> (N, K) values 0..15 (uint8)."""
    n = q.shape[0]
    blocks = q.reshape(n, -1, BLOCK // 2)  # (N, G, 16)
    values = torch.stack([blocks & 0x0F, blocks >> 4], dim=2)  # (N, G, 2, 16): elements j, j + 16
    return values.reshape(n, -1)  # (N, K)


def pack_blocks(values: Tensor) -> Tensor:
    """(N, K) values 0..15 -> (N, K/2) uint8 in the block layout (unpack_blocks' inverse)."""
    n, k = values.shape
    halves = values.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)  # (N, G, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()  # (N, K/2)


def dequantize_blocks(q: Tensor, d: Tensor, m: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The (N, K) weight that 4-bit blocks stand for: q * d + m per block."""
    n = q.shape[0]
    values = unpack_blocks(q).reshape(n, -1, BLOCK).float()  # (N, G, 32)
    w = values * d.float()[..., None] + m.float()[..., None]  # (N, G, 32)
    return w.reshape(n, -1).to(dtype)  # (N, K)


def round_activations(x: Tensor) -> Tensor:
    """x (M, K) as the int4 kernel reads it: rounded to int8 steps of max|block| / 127 per
    block of 32 inputs (half-way cases to even, as the kernel's lrintf)."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)  # (M, G, 32)
    step = blocks.abs().amax(dim=-1, keepdim=True) / 127.0  # (M, G, 1)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    return (torch.round(blocks / safe) * step).reshape(x.shape)  # (M, K)


def int4_linear_reference(x: Tensor, q: Tensor, d: Tensor, m: Tensor, bias: Tensor | None = None) -> Tensor:
    """What `int4_linear` computes, in torch: rounded activations times the 4-bit weights."""
    y = round_activations(x) @ dequantize_blocks(q, d, m).t()  # (M, N)
    return y if bias is None else y + bias


def register_fakes() -> None:
    """Shapes and dtypes of the ops' results, for torch.compile (called once, after loading)."""

    @torch.library.register_fake("qkv::int8_linear")
    def _int8(x: Tensor, w: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("qkv::decode_attention")
    def _attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, scale: float) -> Tensor:
        return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])

    @torch.library.register_fake("qkv::f32_linear")
    def _f32(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("qkv::decoder_layer")
    def _layer(x: Tensor, *args: object) -> Tensor:
        return x.new_empty(x.shape)

    @torch.library.register_fake("qkv::int4_linear")
    def _int4(x: Tensor, q: Tensor, d: Tensor, m: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty(x.shape[0], q.shape[0])

    from qkv.native.quantized_ops import register_quantized_fakes

    register_quantized_fakes()
