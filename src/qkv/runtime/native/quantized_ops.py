"""`qkv::quantized_decode_attention` (csrc/quantized_cache/attention.cpp) as a Python function, and its
fake implementation for torch.compile.

The op is attention of one query per row over qkv.attention.caches.quantized_cache's packed codes;
the cache calls it (`QuantizedKVCache.attend`), nothing else reads those buffers.

Shape legend: B batch, H query heads, D head size of keys, D_v of values.
"""

from __future__ import annotations

import torch
from torch import Tensor

# the kernel's `variant` codes: -1 the active variant, else kernels.h's Variant (build.VARIANTS' order)
VARIANTS = {"best": -1, "generic": 0, "avx2": 1, "avx512": 2}


def quantized_decode_attention(q: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, v_codes: Tensor,
                               v_scale: Tensor, v_zero: Tensor, sink_k: Tensor, sink_v: Tensor, tail_k: Tensor,
                               tail_v: Tensor, held: Tensor, quantized: Tensor, rope_cos: Tensor | None,
                               rope_sin: Tensor | None, *, bits: int, group_size: int, keys_per_channel: bool,
                               scale: float, variant: str = "best") -> Tensor:
    """q (B, H, D) float32 and the cache's tensors (quantized_cache/attention.cpp's header) -> (B, H, D_v)."""
    return torch.ops.qkv.quantized_decode_attention.default(
        q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, sink_k, sink_v, tail_k, tail_v, held, quantized,
        rope_cos, rope_sin, bits, group_size, keys_per_channel, scale, VARIANTS[variant])


def register_quantized_fakes() -> None:
    """The result's shape for torch.compile (called once the library is loaded)."""

    @torch.library.register_fake("qkv::quantized_decode_attention")
    def _quantized(q: Tensor, *args: object) -> Tensor:
        tail_v = args[9]
        assert isinstance(tail_v, Tensor)
        return q.new_empty(q.shape[0], q.shape[1], tail_v.shape[-1])
