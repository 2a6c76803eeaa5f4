"""The server's KV cache measured before it is allocated, and refused when it cannot fit.

    require_kv_memory(model, max_batch=8, capacity=1024)   # QkvError naming the flags, or None

The engine allocates one slot cache of `max_batch` rows at start: per attention layer a key
and a value buffer of (B, H_kv, S, D) elements in the cache's dtype, the row lengths (B,) and
the slot indices (S,).
`--max-batch 1000000` would ask for tens of GB and die in the allocation; here the bytes are
computed from the model's layers (what `DecodeSession` will build: capacity rounded as it
rounds) and compared with the memory this process may still use, before anything is made.

Shape legend: B slots (max_batch), H_kv kv heads, S positions per slot, D head size.
"""

from __future__ import annotations

import torch

from qkv.errors import QkvError
from qkv.runtime.session import cache_capacity
from qkv.models.decoder import CausalDecoder
from qkv.models.hf.untrusted import available_memory, format_size

# The cache may take at most this share of the memory available: the model's activations,
# the tokenizer, Python and the kernels' buffers need the rest.
KV_SHARE = 0.8


def slot_capacity(model: CausalDecoder, capacity: int | None) -> int:
    """Positions per slot the engine's session allocates for `--context capacity`."""
    wanted = model.context_length if capacity is None else min(capacity, model.context_length)
    return cache_capacity(wanted, model.context_length)


def kv_cache_bytes(model: CausalDecoder, *, max_batch: int, capacity: int | None) -> int:
    """Bytes of the engine's slot KV cache: K and V (B, H_kv, S, D) per layer, lengths, slots."""
    positions = slot_capacity(model, capacity)
    itemsize = torch.empty(0, dtype=next(model.parameters()).dtype).element_size()
    total = 0
    for layer in model.attention_layers():
        heads, head_dim = int(layer.num_kv_heads), int(layer.head_dim)
        total += 2 * max_batch * heads * positions * head_dim * itemsize  # K and V: (B, H_kv, S, D)
        total += (max_batch + positions) * 8  # lengths (B,) and slot indices (S,), int64
    return total


def require_kv_memory(model: CausalDecoder, *, max_batch: int, capacity: int | None,
                      available: int | None = None) -> int:
    """The KV cache's bytes; QkvError (one line, naming the flags) when they cannot fit."""
    needed = kv_cache_bytes(model, max_batch=max_batch, capacity=capacity)
    room = available_memory() if available is None else available
    if room is not None and needed > KV_SHARE * room:
        positions = slot_capacity(model, capacity)
        raise QkvError(f"--max-batch {max_batch} with {positions} positions per slot (--context) needs a "
                       f"{format_size(needed)} KV cache, more than {KV_SHARE:.0%} of the {format_size(room)} of "
                       "memory available; lower --max-batch or --context")
    return needed
