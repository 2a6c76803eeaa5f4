"""The native ops as Python functions, their fake implementations (what torch.compile
traces), the variant they run as (`variants`, `use_variant`), the 4-bit block layout
written out in torch, and the products' math in torch (`int8_linear_reference`,
`int4_linear_reference`): what the kernels are tested against, and what the quantized
layers run where the kernels cannot be built (qkv.runtime.linear.quantized).

4-bit blocks (GGUF's Q4_1 layout): a row of K inputs is K/32 blocks; block g of row n has
16 bytes q[n, 16g:16g+16], where byte j holds element j in its low nibble and element j+16
in its high one, and two float16 numbers d[n, g] and m[n, g]: w = q * d + m, q in 0..15.

Shape legend: M rows of x, K inputs, N outputs, G = K / 32 blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

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


def variants() -> list[str]:
    """The variants of the ops this CPU runs, slowest first: "generic" (plain C++), then
    "avx2" and "avx512" (AVX-512 VNNI) where cpuid reports them (qkv.runtime.native.build)."""
    return torch.ops.qkv.variants.default().split(",")


def active_variant() -> str:
    """The variant the ops run now: the CPU's best unless `use_variant` caps it."""
    return torch.ops.qkv.active_variant.default()


@contextmanager
def use_variant(name: str) -> Iterator[None]:
    """Run the ops as variant `name` (or the CPU's best below it) inside the block, for the
    whole process: the tests and the self-test compare variants this way."""
    previous = torch.ops.qkv.set_variant.default(name)
    try:
        yield
    finally:
        torch.ops.qkv.set_variant.default(previous)


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


def activation_codes(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (M, K) as the int4 kernel rounds it: int8 codes (M, G, 32), held in float32, and
    one step per block (M, G), step = max|block| / 127, code = round(x * (1 / step)) with
    half-way cases to even (the kernel's lrintf and cvtps2dq), in the kernel's float32 order."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)  # (M, G, 32)
    step = blocks.abs().amax(dim=-1) / 127.0  # (M, G)
    inverse = torch.where(step > 0, 1.0 / torch.where(step > 0, step, 1.0), 0.0)  # (M, G)
    return torch.round(blocks * inverse[..., None]), step


def round_activations(x: Tensor) -> Tensor:
    """x (M, K) as the int4 kernel reads it: rounded to int8 steps of max|block| / 127 per
    block of 32 inputs (`activation_codes` times their step)."""
    codes, step = activation_codes(x)
    return (codes * step[..., None]).reshape(x.shape)  # (M, K)


# Outputs a reference product takes at a time: its float32 temporaries (the unpacked weights,
# the block dots) stay a few MB whatever the layer (an output head has 49152 rows).
REFERENCE_CHUNK = 1024


def _int4_reference_rows(codes: Tensor, step: Tensor, q: Tensor, d: Tensor, m: Tensor) -> Tensor:
    n, groups = q.shape[0], codes.shape[1]
    values = unpack_blocks(q).reshape(n, groups, BLOCK).float()  # (N, G, 32) in 0..15
    dots = torch.bmm(codes.transpose(0, 1), values.permute(1, 2, 0))  # (G, M, N): integers, exact
    d32, m32 = d.view(torch.float16).float().t(), m.view(torch.float16).float().t()  # (G, N)
    scale = d32[:, None, :] * step.t()[:, :, None]  # (G, M, N): d * step, as the kernel's factors
    sums = step * codes.sum(dim=-1)  # (M, G): step * sum(codes), the kernel's xsum
    return (dots * scale).sum(dim=0) + sums @ m32  # (M, N)


def int4_linear_reference(x: Tensor, q: Tensor, d: Tensor, m: Tensor, bias: Tensor | None = None) -> Tensor:
    """What `int4_linear` computes, in torch, float32 (module docstring): per block the exact
    integer dot of the activation codes and the 4-bit values (a float32 product of integers
    below 2^24 is exact), times d * step, plus m times step * sum(codes); blocks summed in
    float32. The kernel's numbers up to float32 summation order; the fallback where it is
    not built (qkv.runtime.linear.quantized). REFERENCE_CHUNK outputs at a time."""
    codes, step = activation_codes(x)  # (M, G, 32), (M, G)
    y = torch.cat([_int4_reference_rows(codes, step, q[i:i + REFERENCE_CHUNK], d[i:i + REFERENCE_CHUNK],
                                        m[i:i + REFERENCE_CHUNK]) for i in range(0, q.shape[0], REFERENCE_CHUNK)],
                  dim=1)  # (M, N)
    return y if bias is None else y + bias.float()


def int8_linear_reference(x: Tensor, w: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor:
    """What `int8_linear` computes, in torch, float32: (x @ w^T) * scales + bias, taking
    REFERENCE_CHUNK outputs at a time."""
    x32 = x.float()
    y = torch.cat([x32 @ w[i:i + REFERENCE_CHUNK].float().t() for i in range(0, w.shape[0], REFERENCE_CHUNK)],
                  dim=1) * scales.float()  # (M, N)
    return y if bias is None else y + bias.float()


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
    def _layer(x: Tensor, *args: object) -> Tensor:  # (B, C) in, (B, C) out
        return x.new_empty(x.shape)

    @torch.library.register_fake("qkv::int4_linear")
    def _int4(x: Tensor, q: Tensor, d: Tensor, m: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty(x.shape[0], q.shape[0])

    from qkv.runtime.native.quantized_ops import register_quantized_fakes

    register_quantized_fakes()
