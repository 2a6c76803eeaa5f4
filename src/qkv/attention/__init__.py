"""The attention core: masks, the kernel (explicit | fused), RoPE, the KV cache, layers,
ring attention over torch.distributed.

It knows nothing of models, tracing or the CLI. Each name is imported from its module on
first use, as `qkv` does, so a command that needs one part (the book's walkthrough needs
the kernel and the masks) does not load the cache kinds, the layers and ring attention.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "GroupedQueryAttention": "qkv.attention.grouped_query",
    "ATTENTION_KERNELS": "qkv.attention.kernels",
    "attention": "qkv.attention.kernels",
    "explicit_attention": "qkv.attention.kernels",
    "fused_attention": "qkv.attention.kernels",
    "one_query_attention": "qkv.attention.kernels",
    "repeat_kv": "qkv.attention.kernels",
    "KVCache": "qkv.attention.caches.kv_cache",
    "QuantizedKVCache": "qkv.attention.caches.quantized_cache",
    "SinkKVCache": "qkv.attention.caches.sink_cache",
    "WindowKVCache": "qkv.attention.caches.window_cache",
    "cache_kind_for": "qkv.attention.caches.window_cache",
    "causal_mask": "qkv.attention.masks",
    "combine_masks": "qkv.attention.masks",
    "padding_mask": "qkv.attention.masks",
    "Ring": "qkv.attention.ring",
    "ShardLayout": "qkv.attention.ring",
    "ring_attention": "qkv.attention.ring",
    "ring_for": "qkv.attention.ring",
    "RMSNorm": "qkv.attention.rmsnorm",
    "Llama3RopeScaling": "qkv.attention.rope",
    "RotaryEmbedding": "qkv.attention.rope",
    "apply_rope": "qkv.attention.rope",
    "inverse_frequencies": "qkv.attention.rope",
    "rotate_half": "qkv.attention.rope",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # once found, an ordinary attribute
        return value
    raise AttributeError(f"module 'qkv.attention' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
