"""A sink cache (StreamingLLM): the first `sinks` tokens plus a window of recent tokens.

    kind = SinkKVCache.kind(sinks=4, window=252)    # holds sinks + window positions
    model.setup_cache(batch, capacity, kind=kind)   # capacity is not a limit on positions

Most heads put much of their weight on the first tokens, whatever they say (attention
sinks); dropping them when a window slides past them is what makes window attention
collapse. Keeping them, plus the newest `window` tokens, lets generation run on past the
cache's capacity with a fixed memory.

Positions: keys arrive rotated (RoPE applied by the layer at their true positions) and are
stored as they are, position p at slot p for a sink, slot sinks + (p - sinks) % window
otherwise. Queries are rotated at their true positions too, so every query-key pair sees
its true relative distance: exact for the window, and the sinks sit at their true (far)
distance. StreamingLLM instead stores keys unrotated and rotates them by their slot, so
that no distance exceeds the cache size (needed to go past a model's trained context);
that needs the layer to hand over pre-RoPE keys, and the layer's interface is kept here.
transformers' SinkCache re-rotated keys it had already rotated and mixed the two up.
Because positions keep growing, `max_position` is unbounded: the model's context length
is then the only limit on positions.

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

from qkv.attention.kv_cache import CacheKind, CacheSpec, KVCache


class SinkKVCache(KVCache):
    """`sinks` first positions kept forever, then a ring of the `window` newest."""

    k_cache: Tensor
    v_cache: Tensor
    key_positions: Tensor
    next_position: Tensor

    def __init__(self, spec: CacheSpec, *, sinks: int = 4, window: int = 252) -> None:
        if window < 1 or sinks < 0:
            raise ValueError(f"a sink cache needs window >= 1 and sinks >= 0, got window={window}, sinks={sinks}")
        super().__init__(spec)
        self.sinks, self.window = sinks, window
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

    @classmethod
    def kind(cls, *, sinks: int = 4, window: int = 252) -> CacheKind:
        return functools.partial(cls, sinks=sinks, window=window)

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

    def contents(self) -> tuple[Tensor, Tensor]:
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
