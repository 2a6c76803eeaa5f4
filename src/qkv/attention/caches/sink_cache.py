"""A sink cache (StreamingLLM): the first `sinks` tokens plus a window of recent tokens.

    kind = SinkKVCache.kind(sinks=4, window=252)    # holds sinks + window positions
    DecodeSession(model, batch_size=batch, capacity=capacity, kind=kind)   # qkv.runtime; capacity is not a limit on positions

Most heads put much of their weight on the first tokens, whatever they say (attention
sinks); dropping them when a window slides past them is what makes window attention
collapse. Keeping them, plus the newest `window` tokens, lets generation run on past the
cache's capacity with a fixed memory.

Positions, with RoPE (the model hands the cache its rotary embedding): keys are stored
*unrotated* and rotated when read, by a position inside the cache rather than their true
one (StreamingLLM's scheme). For a call whose first new token sits at true position p0, the
cache subtracts shift = max(0, p0 - sinks - window) from every position it rotates by:
window keys (true positions >= p0 - window) then sit at sinks .. sinks + window - 1, the new
tokens just after, and the sinks keep 0 .. sinks - 1. Queries are rotated at the same
shifted positions (`rope_positions`), so every query-window pair keeps its exact true
distance, while sinks sit at most sinks + window + T positions away, and no rotation angle
ever exceeds what the model was trained on: generation goes on past the model's context
length. Rotating keys at their true positions instead would put the sinks ever further away
and, past the context length, at angles the model has never seen. transformers' SinkCache
re-rotated keys it had already rotated and mixed the two up; storing them unrotated makes
each read one rotation from the raw key, so no rounding accumulates.
Without RoPE (GPT-2's learned positions are baked into its keys) keys are stored as given
and true positions apply, so the model's context length stays the limit.

`update` answers with the cache's slots before the write followed by the new tokens
(S = sinks + window + T), and the mask: a query at position p sees a key at position k
when k <= p and (k < sinks or k > p - window). Writing after reading keeps every query of a
long chunk exact even where the chunk itself overwrites the window. No tensor is read
into Python; a decode step (T = 1) has the same shapes at every length.

Shape legend: B batch, H_kv key/value heads, T new tokens, S keys read, D head size of
keys, D_v of values, W window.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import Tensor

from qkv.attention.caches.kv_cache import CacheKind, CacheSpec, KVCache
from qkv.attention.rope import apply_rope


class SinkKVCache(KVCache):
    """`sinks` first positions kept forever, then a ring of the `window` newest."""

    k_cache: Tensor
    v_cache: Tensor
    key_positions: Tensor
    next_position: Tensor

    def __init__(self, spec: CacheSpec, *, sinks: int = 4, window: int = 252,
                 prefill_chunk: int | None = None) -> None:
        if window < 1 or sinks < 0 or (prefill_chunk is not None and prefill_chunk < 1):
            raise ValueError(f"a sink cache needs window >= 1, sinks >= 0 and prefill_chunk >= 1, got "
                             f"window={window}, sinks={sinks}, prefill_chunk={prefill_chunk}")
        super().__init__(spec)
        self.sinks, self.window = sinks, window
        self._prefill_chunk = window if prefill_chunk is None else prefill_chunk
        s = spec
        size = sinks + window
        kw = {"dtype": s.dtype, "device": s.device}
        self.register_buffer("k_cache", torch.zeros(s.batch_size, s.num_kv_heads, size, s.head_dim, **kw),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(s.batch_size, s.num_kv_heads, size, s.value_dim, **kw),
                             persistent=False)
        # The true position held by each slot (-1 = empty).
        self.register_buffer("key_positions", torch.full((size,), -1, dtype=torch.long, device=s.device),
                             persistent=False)
        self.register_buffer("next_position", torch.zeros((), dtype=torch.long, device=s.device),
                             persistent=False)

    # A kind whose positions are not bounded by its size (see `streams_past_context`).
    streams = True

    @classmethod
    def kind(cls, *, sinks: int = 4, window: int = 252, prefill_chunk: int | None = None) -> CacheKind:
        """prefill_chunk: the most tokens a session feeds per call (default: the window); a
        call rotates new tokens up to sinks + window + its length."""
        return functools.partial(cls, sinks=sinks, window=window, prefill_chunk=prefill_chunk)

    @property
    def rotates_keys(self) -> bool:
        return self.spec.rotary is not None

    def _shift(self, positions: Tensor) -> Tensor:
        """() how far this call's positions are moved back before rotating (see the module
        docstring); computed from the first new position, without reading it into Python."""
        return (positions[0] - (self.sinks + self.window)).clamp(min=0)

    def rope_positions(self, positions: Tensor) -> Tensor:
        if not self.rotates_keys:
            return positions
        return positions - self._shift(positions)

    @property
    def prefill_chunk(self) -> int:
        return self._prefill_chunk

    @property
    def capacity(self) -> int:
        return self.sinks + self.window

    @property
    def max_position(self) -> int:
        return sys.maxsize

    def slots_for(self, positions: Tensor) -> Tensor:
        """(T,) true positions -> (T,) slots."""
        ring = self.sinks + torch.remainder(positions - self.sinks, self.window)
        return torch.where(positions < self.sinks, positions, ring)

    def update(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.check_input(k, v, positions)
        if positions.dim() != 1:
            raise ValueError("a sink KV cache takes positions shared by every row, shape (T,)")
        k, v = k.to(self.k_cache.dtype), v.to(self.v_cache.dtype)
        keys = torch.cat([self.k_cache, k], dim=2)  # (B, H_kv, S, D)
        values = torch.cat([self.v_cache, v], dim=2)  # (B, H_kv, S, D_v)
        key_pos = torch.cat([self.key_positions, positions.long()])  # (S,)
        if self.spec.rotary is not None:  # rotate by positions inside the cache
            shift = self._shift(positions.long())
            read_pos = torch.where(key_pos < self.sinks, key_pos, key_pos - shift).clamp(min=0)  # (S,)
            cos, sin = self.spec.rotary(read_pos, dtype=keys.dtype)  # (S, D)
            keys = apply_rope(keys, cos, sin)
        q = positions.long()[:, None]  # (T, 1)
        kp = key_pos[None, :]  # (1, S)
        visible = (kp >= 0) & (kp <= q) & ((kp < self.sinks) | (kp > q - self.window))  # (T, S)
        # Write in chunks of at most `window` positions, so no chunk writes a slot twice.
        t = k.shape[2]
        for begin in range(0, t, self.window):
            part = positions[begin:begin + self.window].long()
            slots = self.slots_for(part)  # (t',)
            self.k_cache.index_copy_(2, slots, k[:, :, begin:begin + self.window])
            self.v_cache.index_copy_(2, slots, v[:, :, begin:begin + self.window])
            self.key_positions.index_copy_(0, slots, part)
        self.next_position.copy_(torch.maximum(self.next_position, positions.max() + 1))
        return keys, values, visible[None, None]  # (1, 1, T, S)

    def reset(self) -> None:
        self.key_positions.fill_(-1)
        self.next_position.zero_()

    def truncate(self, length: int) -> None:
        """Forget positions >= length. Positions the window already evicted stay lost, so
        after a rewind the window holds fewer tokens until new ones refill it."""
        self.key_positions.masked_fill_(self.key_positions >= length, -1)
        self.next_position.clamp_(max=length)

    def contents(self) -> tuple[Tensor, Tensor]:
        """Held keys (unrotated when the cache rotates them itself) and values, oldest first."""
        held = (self.key_positions >= 0).nonzero().squeeze(1)  # (n,)
        order = held[self.key_positions[held].argsort()]
        return self.k_cache[:, :, order], self.v_cache[:, :, order]

    @property
    def length(self) -> int:
        """One past the furthest position written (not the number of slots in use): where
        the next token goes."""
        return int(self.next_position)

    @property
    def nbytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in self.buffers())

    def extra_repr(self) -> str:
        return f"sinks={self.sinks}, window={self.window}"
