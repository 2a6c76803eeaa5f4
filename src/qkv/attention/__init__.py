"""The attention core: masks, the kernel (explicit | fused), RoPE, the KV cache, layers,
ring attention over torch.distributed.

It knows nothing of models, tracing or the CLI.
"""

from qkv.attention.grouped_query import GroupedQueryAttention
from qkv.attention.kernels import (
    BACKENDS, attention, explicit_attention, fused_attention, one_query_attention, repeat_kv,
)
from qkv.attention.kv_cache import KVCache
from qkv.attention.quantized_cache import QuantizedKVCache
from qkv.attention.sink_cache import SinkKVCache
from qkv.attention.masks import causal_mask, combine_masks, padding_mask
from qkv.attention.ring import Ring, ShardLayout, ring_attention, ring_for
from qkv.attention.rmsnorm import RMSNorm
from qkv.attention.rope import Llama3RopeScaling, RotaryEmbedding, apply_rope, inverse_frequencies, rotate_half

__all__ = [
    "BACKENDS",
    "GroupedQueryAttention",
    "KVCache",
    "QuantizedKVCache",
    "Llama3RopeScaling",
    "RMSNorm",
    "Ring",
    "RotaryEmbedding",
    "ShardLayout",
    "SinkKVCache",
    "apply_rope",
    "attention",
    "causal_mask",
    "combine_masks",
    "explicit_attention",
    "fused_attention",
    "inverse_frequencies",
    "one_query_attention",
    "padding_mask",
    "repeat_kv",
    "ring_attention",
    "ring_for",
    "rotate_half",
]
