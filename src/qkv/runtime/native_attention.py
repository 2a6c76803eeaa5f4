"""qkv's native decode attention, registered as the "one_query" attention function (and its
attention over a quantized KV cache's packed codes as "quantized_decode").

The attention core (qkv.attention) knows nothing of qkv's C++; the runtime, once the native
library has loaded and passed its self-test, registers its decode attention under the name
the core looks up for a single query (qkv.attention.registry). Same math as the reductions
it replaces (softmax over the visible keys, zeros where none is), to float rounding; calls
it cannot take (not float32 on the CPU, gradients, other shapes) go to the reductions.
The kernel took 28 us for SmolLM2's 9 heads over 256 cached positions, where Inductor's
fused reductions (with RoPE and the cache write) took about 75 us a layer.

Shape legend: B batch, H query heads, H_kv key/value heads, S keys, D head size.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkv.attention.kernels import reduction_attention
from qkv.attention.registry import register_attention
from qkv.runtime.native import native_kernels
from qkv.runtime.native.ops import decode_attention
from qkv.runtime.native.quantized_ops import quantized_decode_attention


def _fits(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> bool:
    return (q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and q.shape[-2] == 1
            and q.shape[0] == k.shape[0] == v.shape[0] and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0
            and q.dtype == k.dtype == v.dtype == torch.float32 and q.device.type == "cpu"
            and not (q.requires_grad or k.requires_grad or v.requires_grad)
            and (mask is None or mask.dtype == torch.bool))


def native_one_query(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, scale: float | None = None,
                     is_causal: bool = False, dropout_p: float = 0.0) -> Tensor:
    """(B, H, 1, D) queries over (B, H_kv, S, D) keys -> (B, H, 1, D_v), on qkv's kernel."""
    if not _fits(q, k, v, mask):
        return reduction_attention(q, k, v, mask=mask, scale=scale)
    b, h, _, d = q.shape
    s = k.shape[-2]
    visible = None if mask is None else torch.broadcast_to(mask, (b, h, 1, s)).reshape(b, h, s).contiguous()
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = decode_attention(q.reshape(b, h, d).contiguous(), k.contiguous(), v.contiguous(), visible, scale)  # (B, H, D_v)
    return out.unsqueeze(2)  # (B, H, 1, D_v)


def register_native_attention() -> bool:
    """Register `native_one_query` as "one_query" when qkv's kernels are available; whether it was."""
    if not native_kernels().available:
        return False
    register_attention("one_query", native_one_query)
    register_attention("quantized_decode", quantized_decode_attention)  # called by a quantized cache with its codes
    return True
