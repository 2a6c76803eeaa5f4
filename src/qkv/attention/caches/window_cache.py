"""A sliding-window KV cache: a local layer keeps only the keys its queries can still see.

    kind = WindowKVCache.kind(window=512)              # one local layer's cache
    kinds = [cache_kind_for(w, StaticKVCache) for w in layer_windows]   # per layer

A sliding-window layer (Mistral, Gemma 2/3's local layers) lets the query at position p see
the keys at positions p - W < k <= p, itself included. Keys older than that are never read
again, so the cache is a ring of W slots: position p lives at slot p mod W, and its memory
stays flat however long the conversation grows (a full cache grows by one slot a token).

Positions are tensors: `key_positions` (B, W) says which position each slot of each row
holds (-1: empty), and the mask is derived from it. `update` answers with the slots as they
were before the call followed by the new tokens (S = W + T) and the mask

    visible[b, t, s] = 0 <= kp[b, s] <= p[b, t]  and  kp[b, s] > p[b, t] - W

then keeps, per row, the newest W of them. Reading before writing keeps a prompt of T > W
tokens exact: each of its queries still sees its own last W keys, some of which the same
call evicts. A decode step (T = 1) writes first and answers with the ring itself (S = W, no
copy): the one key it evicts, p - W, lies outside its query's window. A decode step has the
same shapes at every length, and nothing in `update` reads a tensor back into Python.

Rows may differ: positions (B, T) put each row at its own positions; a negative position
marks a padding token, neither stored nor seen (its query sees nothing and attends to
zeros). A call at positions starting at p also hides what a row held at p and beyond (a
rewind, or padding written there earlier): the new tokens replace it, as a full cache's
writes overwrite its slots. Tokens a call does not keep (padding, or all but the newest W
of a long prompt) are written to one scratch slot past the ring that nothing ever reads,
so every write is one scatter with distinct targets in the ring.

Shape legend: B batch, H_kv key/value heads, T new tokens, S keys read (W + T), D head size
of keys, D_v of values, W window (slots of the ring).
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import Tensor

from qkv.attention.caches.kv_cache import CacheKind, CacheSpec, KVCache, SlotSelection

_NO_POSITION = torch.iinfo(torch.long).max  # larger than any position: "this row writes nothing"


class WindowKVCache(KVCache):
    """A ring of the newest `window` positions per row, for a layer that sees no further."""

    # Attention layers with their own sliding-window mask skip it for a cache that applies
    # the window itself (this one's mask already hides keys at p - W and before).
    windowed = True

    k_cache: Tensor
    v_cache: Tensor
    key_positions: Tensor
    lengths: Tensor
    row_indices: Tensor

    def __init__(self, spec: CacheSpec, *, window: int, selection: SlotSelection | None = None) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"a sliding-window cache holds at least one key: window must be a positive "
                             f"integer, got {window!r}")
        super().__init__(spec)
        s = spec
        self.window = window
        # A session that never goes past `capacity` positions needs no more slots than that.
        self.ring = min(window, s.capacity)
        kw = {"dtype": s.dtype, "device": s.device}
        slots = self.ring + 1  # the ring, then one scratch slot for writes that are not kept
        self.register_buffer("k_cache", torch.zeros(s.batch_size, s.num_kv_heads, slots, s.head_dim, **kw),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(s.batch_size, s.num_kv_heads, slots, s.value_dim, **kw),
                             persistent=False)
        self.register_buffer("key_positions", torch.full((s.batch_size, slots), -1, dtype=torch.long,
                                                         device=s.device), persistent=False)  # (B, W + 1)
        # Per row: one past the furthest position held (what `length` reports).
        self.register_buffer("lengths", torch.zeros(s.batch_size, dtype=torch.long, device=s.device),
                             persistent=False)
        self.register_buffer("row_indices", torch.arange(s.batch_size, device=s.device), persistent=False)
        # Like SlotKVCache: while the session's selection names rows, a call carries only
        # those batch rows (b,), a server's occupied slots. Its `limit` needs no action
        # here: a call reads at most W + T keys whatever the rows hold.
        self.selection = SlotSelection() if selection is None else selection

    @property
    def rows(self) -> Tensor | None:
        return self.selection.rows

    @property
    def limit(self) -> int | None:
        return self.selection.limit

    @classmethod
    def kind(cls, *, window: int, selection: SlotSelection | None = None) -> CacheKind:
        """selection: the session's slot rows, shared with its SlotKVCaches (a server's)."""
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive integer, got {window!r}")
        return functools.partial(cls, window=window, selection=selection)

    @property
    def capacity(self) -> int:
        """Slots held per row (the ring), not the positions a row may reach."""
        return self.ring

    @property
    def max_position(self) -> int:
        # A full window wraps around and takes any position; a ring shortened to the
        # session's capacity only holds positions below it.
        return sys.maxsize if self.ring == self.window else self.spec.capacity

    def kernel_rows(self) -> Tensor | None:
        return self.rows

    def kernel_ring(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For a kernel that runs a whole decode step itself (`qkv.runtime.layer_step`,
        runtime/native/csrc/layer.cpp): keys (B, H_kv, W + 1, D), values (B, H_kv, W + 1, D_v), lengths (B,)
        and key_positions (B, W + 1), which it updates as a decode step of `update` does:
        forget what a row held at its position p and beyond, write p at slot p mod W, attend
        over the slots holding p - window < kp <= p. (`kernel_buffers` stays None: a kernel
        that writes slot p would break the ring.)"""
        return self.k_cache, self.v_cache, self.lengths, self.key_positions

    def update(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        rows = self.rows
        if rows is None:
            self.check_input(k, v, positions)
            rows = self.row_indices
        else:
            self._check_rows(k, v, positions, rows)
        b, t = k.shape[0], k.shape[2]
        ring = self.ring
        pos = positions.long()
        if pos.dim() == 1:
            pos = pos.expand(b, t)  # (B, T)
        real = pos >= 0  # (B, T)
        first = torch.where(real, pos, _NO_POSITION).min(dim=1).values  # (B,)
        last = torch.where(real, pos, -1).max(dim=1).values  # (B,)

        if self.rows is None:  # every row: the buffers as they are
            held, cached_k, cached_v = self.key_positions, self.k_cache, self.v_cache
        else:  # some rows: theirs only, (b, ...)
            held, cached_k, cached_v = (buf.index_select(0, rows) for buf in
                                        (self.key_positions, self.k_cache, self.v_cache))
        held = held[:, :ring]  # (B, W)
        held = held.masked_fill(held >= first[:, None], -1)  # replaced by this call's tokens
        new = pos.masked_fill(~real, -1)  # (B, T)
        # One new token on every row (a decode step): written first, then the ring is read in
        # place (S = W, no copy): the key it evicts, p - W, is outside its window anyway.
        in_place = t == 1 and self.rows is None
        if not in_place:  # the ring as it was, then the new keys (S = W + T)
            key_pos = torch.cat([held, new], dim=1)  # (B, S)
            keys = torch.cat([cached_k[:, :, :ring], k.to(self.k_cache.dtype)], dim=2)  # (B, H_kv, S, D)
            values = torch.cat([cached_v[:, :, :ring], v.to(self.v_cache.dtype)], dim=2)  # (B, H_kv, S, D_v)

        # Keep the newest W of each row; the rest go to the scratch slot (index `ring`).
        # Kept positions span fewer than W consecutive integers, so their slots are distinct.
        keep = real & (pos > (last[:, None] - ring))  # (B, T)
        slots = torch.where(keep, torch.remainder(pos, ring), ring)  # (B, T)
        row_index = rows[:, None]  # (B, 1)
        self.key_positions[rows, :ring] = held  # forget what this call replaces
        self.k_cache[row_index, :, slots] = k.transpose(1, 2).to(self.k_cache.dtype)  # (B, T, H_kv, D)
        self.v_cache[row_index, :, slots] = v.transpose(1, 2).to(self.v_cache.dtype)
        self.key_positions[row_index, slots] = pos
        self.key_positions[:, ring] = -1  # the scratch slot holds nothing
        wrote = real.any(dim=1)  # (B,)
        self.lengths[rows] = torch.where(wrote, last + 1, self.lengths.index_select(0, rows))
        if in_place:
            key_pos = self.key_positions[:, :ring]  # (B, S), S = W
            keys, values = self.k_cache[:, :, :ring], self.v_cache[:, :, :ring]  # (B, H_kv, S, D)
        query = new[:, :, None]  # (B, T, 1)
        kp = key_pos[:, None, :]  # (B, 1, S)
        visible = (kp >= 0) & (kp <= query) & (kp > query - self.window) & (query >= 0)  # (B, T, S)
        return keys, values, visible[:, None]  # (B, 1, T, S)

    def _check_rows(self, k: Tensor, v: Tensor, positions: Tensor, rows: Tensor) -> None:
        s, b = self.spec, rows.shape[0]
        t = k.shape[2] if k.dim() == 4 else -1
        if (k.dim() != 4 or v.dim() != 4 or k.shape[0] != b or v.shape[:3] != k.shape[:3]
                or (k.shape[1], k.shape[3], v.shape[3]) != (s.num_kv_heads, s.head_dim, s.value_dim)
                or positions.shape not in ((t,), (b, t))):
            raise ValueError(
                f"a call on {b} row(s) takes keys ({b}, {s.num_kv_heads}, T, {s.head_dim}) and "
                f"positions (T,) or ({b}, T), got keys {tuple(k.shape)} and positions {tuple(positions.shape)}"
            )

    def _window_is_whole(self, row_positions: Tensor, length: int) -> bool:
        """Whether a row cut back to `length` positions still holds every key its next
        query (at `length`) sees: positions length - W + 1 .. length - 1, those that exist."""
        needed = range(max(0, length - self.window + 1), length)
        held = set(row_positions.tolist())
        return all(p in held for p in needed)

    def reset(self) -> None:
        self.key_positions.fill_(-1)
        self.lengths.zero_()

    def truncate(self, length: int) -> None:
        """Keep positions < length. A row whose ring already evicted keys the position
        `length` needs cannot rewind there: that is refused (reset and prefill instead)."""
        kept = self.key_positions.masked_fill(self.key_positions >= length, -1)
        for row in range(self.spec.batch_size):
            cut = min(length, int(self.lengths[row]))
            if cut < int(self.lengths[row]) and not self._window_is_whole(kept[row], cut):
                raise NotImplementedError(
                    f"this sliding-window KV cache cannot rewind row {row} to position {cut}: its window "
                    "already evicted keys that position sees; reset it instead")
        self.key_positions.copy_(kept)
        self.lengths.clamp_(max=length)

    def copy_row(self, source: int, target: int, length: int) -> None:
        """Row `target` holds row `source`'s positions below `length` (and nothing after)."""
        kept = self.key_positions[source].masked_fill(self.key_positions[source] >= length, -1)
        if not self._window_is_whole(kept, min(length, int(self.lengths[source]))):
            raise NotImplementedError(
                f"row {source} of this sliding-window KV cache no longer holds the window of position "
                f"{length}; prefill the row instead")
        self.k_cache[target] = self.k_cache[source]  # (H_kv, W + 1, D)
        self.v_cache[target] = self.v_cache[source]
        self.key_positions[target] = kept
        self.lengths[target] = min(length, int(self.lengths[source]))

    def held_positions(self) -> Tensor:
        """(B, W) the position each slot of the ring holds (-1: empty)."""
        return self.key_positions[:, :self.ring]

    def contents(self) -> tuple[Tensor, Tensor]:
        """Each row's held keys and values oldest first, (B, H_kv, n, D), n the most any row
        holds; a row holding fewer starts with that many empty slots."""
        held = self.held_positions()
        n = int((held >= 0).sum(dim=1).max())
        order = held.argsort(dim=1)[:, self.ring - n:]  # (B, n): empty slots (-1) sort first
        s = self.spec
        k_index = order[:, None, :, None].expand(s.batch_size, s.num_kv_heads, n, s.head_dim)
        v_index = order[:, None, :, None].expand(s.batch_size, s.num_kv_heads, n, s.value_dim)
        return self.k_cache.gather(2, k_index), self.v_cache.gather(2, v_index)

    @property
    def length(self) -> int:
        """One past the furthest position held by the longest row: where its next token goes."""
        return int(self.lengths.max())

    @property
    def nbytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in self.buffers())

    def extra_repr(self) -> str:
        s = self.spec
        return f"batch={s.batch_size}, kv_heads={s.num_kv_heads}, window={self.window}, head_dim={s.head_dim}"


def sliding_window_mask(num_queries: int, num_keys: int, window: int, *,
                device: torch.device | str | None = None) -> Tensor:
    """(T, S) True where a key lies within the last `window` positions of a query, the
    queries being the last T of the S keys (as `causal_mask` aligns them): key s is visible
    to query i when s > (S - T + i) - window. Causality is `causal_mask`'s: AND the two."""
    if num_queries < 0 or num_keys < num_queries or window < 1:
        raise ValueError(f"sliding_window_mask needs 0 <= num_queries <= num_keys and window >= 1, got "
                         f"num_queries={num_queries}, num_keys={num_keys}, window={window}")
    query_pos = torch.arange(num_queries, device=device)[:, None] + (num_keys - num_queries)  # (T, 1)
    key_pos = torch.arange(num_keys, device=device)[None, :]  # (1, S)
    return key_pos > query_pos - window  # (T, S)


def cache_kind_for(window: int | None, base_kind: CacheKind, *,
                   selection: SlotSelection | None = None) -> CacheKind:
    """The cache kind of one layer: `base_kind` for a global layer (window None), a
    sliding-window ring of `window` slots for a local one, whatever the base kind (a
    quantized or sink cache of a local layer would hold more, or other keys, than the
    layer reads; the ring is exact and already bounded). `selection`: a session of slots
    shares its SlotSelection with the rings too, so they carry the same rows."""
    if window is None:
        return base_kind
    return WindowKVCache.kind(window=window, selection=selection)


def cache_kinds_for(windows: list[int | None], base_kind: CacheKind, *,
                    selection: SlotSelection | None = None) -> list[CacheKind]:
    """One kind per layer, from each layer's window (None: global)."""
    return [cache_kind_for(window, base_kind, selection=selection) for window in windows]
