"""KV caches: the keys and values of earlier tokens, kept for reuse while generating.

The interface attention layers call is `KVCache.update`:

    keys, values, visible = cache.update(k (B, H_kv, T, D), v (B, H_kv, T, D_v), positions)

`positions` are the absolute positions of the T new tokens, (T,) shared by every row or
(B, T) per row, carried as tensors. The cache writes the new entries, and answers with what
attention must read and a boolean mask `visible` (B or 1, 1, T, S) derived from the
positions (True = the query may attend to that key). Causality lives in that mask, so a
layer with a cache calls the kernel with `is_causal=False`.

Shapes are static: the buffers are preallocated at a fixed capacity and written in place,
the answer always has S = capacity keys, and the mask hides what is not (yet) there. A
decode step therefore has the same shapes at every length, which is what lets a compiled
step be one graph for every length up to the capacity. Nothing in `update` reads a tensor
back into Python.

Other kinds of cache (quantized keys, attention sinks with a window, one slot per request)
subclass `KVCache`; the models never look inside one. A decode session
(`qkv.runtime.DecodeSession`) owns its caches: it calls `kind(spec)` once per attention layer
with the layer's `CacheSpec` and hands the list to each forward call (`caches=`).

Shape legend: B batch, H_kv key/value heads, T new tokens, S keys read (the capacity),
D head size of keys, D_v of values.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from qkv.attention.rope import RotaryEmbedding


@dataclass(frozen=True)
class CacheSpec:
    """What one attention layer needs cached: everything a cache kind is built from."""

    batch_size: int
    num_kv_heads: int
    capacity: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device
    layer_index: int = 0
    # The model's RoPE (None without RoPE): a kind that rotates keys itself when it reads
    # them (`KVCache.rotates_keys`) needs it; the others ignore it.
    rotary: RotaryEmbedding | None = None

    def __post_init__(self) -> None:
        sizes = {
            "batch_size": self.batch_size, "num_kv_heads": self.num_kv_heads,
            "capacity": self.capacity, "head_dim": self.head_dim, "value_dim": self.value_dim,
        }
        bad = {name: size for name, size in sizes.items() if not isinstance(size, int) or size < 1}
        if bad:
            raise ValueError(
                "KV cache sizes must be positive integers, got "
                + ", ".join(f"{name}={size!r}" for name, size in bad.items())
            )


class KVCache(nn.Module, ABC):
    """The interface: `update` (write, then read what attention needs), `reset`, and what
    the cache reports about itself (`length`, `capacity`, `batch_size`, `nbytes`)."""

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__()
        self.spec = spec

    @abstractmethod
    def update(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write new keys/values at `positions`; return (keys, values, visible)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every cached token (buffers are kept and overwritten later)."""

    def truncate(self, length: int) -> None:
        """Keep only positions < length (a chat whose new prompt diverges from what is
        cached rewinds to the common prefix). Kinds that cannot rewind say so."""
        raise NotImplementedError(f"{type(self).__name__} cannot be rewound; reset it instead")

    @abstractmethod
    def contents(self) -> tuple[Tensor, Tensor]:
        """The cached keys and values in position order, (B, H_kv, length, D): for tracing
        and inspection, not for the hot path (it may read tensors back into Python)."""

    @property
    @abstractmethod
    def length(self) -> int:
        """How many positions are held (the longest row). Reads a tensor: not for hot paths."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Memory held by the cache's tensors, in bytes."""

    @property
    def capacity(self) -> int:
        return self.spec.capacity

    @property
    def max_position(self) -> int:
        """One past the furthest position this cache can hold: its capacity, unless the
        kind wraps around (a sink/window cache evicts old tokens and takes any position)."""
        return self.capacity

    @property
    def batch_size(self) -> int:
        return self.spec.batch_size

    @property
    def rotates_keys(self) -> bool:
        """True when the cache takes keys before RoPE and rotates them itself as it reads
        them; the layer then rotates only its queries, at `rope_positions(positions)`."""
        return False

    def rope_positions(self, positions: Tensor) -> Tensor:
        """The positions RoPE rotates the new tokens' queries by: their true positions,
        unless the kind re-numbers what it holds (a sink cache past its size)."""
        return positions

    @property
    def attends_decode_step(self) -> bool:
        """True when the cache attends a one-token decode step itself (`decode_attention`):
        it keeps a compact stored form (codes) that its own kernel reads, so attention never
        reads its buffers (qkv.attention.caches.quantized_cache)."""
        return False

    def decode_attention(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
                         scale: float | None = None) -> Tensor:
        """Write one token's keys/values and attend the queries (B, H, 1, D) over what is
        held -> (B, H, 1, D_v); only kinds with `attends_decode_step`."""
        raise NotImplementedError(f"{type(self).__name__} does not attend decode steps itself")

    def kernel_buffers(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """For a kernel that runs a whole decode step itself (`qkv.runtime.layer_step`): the
        buffers (keys (B, H_kv, S, D), values (B, H_kv, S, D_v), lengths (B,) int64) when this
        kind stores position p of row b at slot p, and a query at p reads slots <= p; else
        None (the layer then calls `update`)."""
        return None

    def kernel_rows(self) -> Tensor | None:
        """With `kernel_buffers`: the cache rows the next call carries, (b,) int64, or None
        when row r of the call is cache row r."""
        return None

    @property
    def prefill_chunk(self) -> int | None:
        """The most new tokens one call may carry (None: no limit)."""
        return None

    def check_input(self, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Shapes only (no tensor is read): a wrong call fails with a line naming it."""
        s = self.spec
        t = k.shape[2] if k.dim() == 4 else -1
        if (
            k.dim() != 4 or v.dim() != 4
            or (k.shape[0], k.shape[1], k.shape[3]) != (s.batch_size, s.num_kv_heads, s.head_dim)
            or (v.shape[0], v.shape[1], v.shape[2], v.shape[3]) != (s.batch_size, s.num_kv_heads, t, s.value_dim)
        ):
            raise ValueError(
                f"this KV cache holds batch {s.batch_size} x {s.num_kv_heads} heads of size "
                f"{s.head_dim} (values {s.value_dim}), got keys of shape {tuple(k.shape)} and "
                f"values of shape {tuple(v.shape)}"
            )
        if positions.dtype not in (torch.int64, torch.int32) or positions.shape not in (
            (t,), (s.batch_size, t)
        ):
            raise ValueError(
                f"positions must be integers of shape ({t},) or ({s.batch_size}, {t}), got "
                f"{positions.dtype} of shape {tuple(positions.shape)}"
            )


CacheKind = Callable[[CacheSpec], KVCache]


def visible_keys(key_positions: Tensor, positions: Tensor) -> Tensor:
    """The causal mask derived from positions: a query at position p sees the keys at
    positions <= p. key_positions (S,) or (B, S); positions (T,) or (B, T).
    -> (B or 1, 1, T, S) booleans."""
    if positions.dim() == 1:
        positions = positions[None]  # (1, T)
    if key_positions.dim() == 1:
        key_positions = key_positions[None]  # (1, S)
    return (key_positions[:, None, None, :] <= positions[:, None, :, None])  # (B, 1, T, S)


class StaticKVCache(KVCache):
    """Preallocated (B, H_kv, capacity, D) buffers; position p is written at slot p.

    A decode step allocates nothing but the mask, and each new token costs one row of
    attention instead of a recomputation of the prefix. Slots beyond a query's position
    are hidden by the mask, so stale entries (from a rewind, or a padded prompt row
    shorter than the others) are never read: the next write at that position replaces them.
    The buffers are not persistent: they never end up in a checkpoint.
    """

    k_cache: Tensor
    v_cache: Tensor
    lengths: Tensor
    slots: Tensor

    def __init__(self, spec: CacheSpec) -> None:
        super().__init__(spec)
        s = spec
        kw = {"dtype": s.dtype, "device": s.device}
        self.register_buffer("k_cache", torch.zeros(s.batch_size, s.num_kv_heads, s.capacity, s.head_dim, **kw),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(s.batch_size, s.num_kv_heads, s.capacity, s.value_dim, **kw),
                             persistent=False)
        # Per row: one past the furthest position written (what `length` reports).
        self.register_buffer("lengths", torch.zeros(s.batch_size, dtype=torch.long, device=s.device),
                             persistent=False)
        self.register_buffer("slots", torch.arange(s.capacity, device=s.device), persistent=False)  # (S,)

    def update(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.check_input(k, v, positions)
        if positions.dim() == 1:  # every row writes the same slots
            self.k_cache.index_copy_(2, positions, k.to(self.k_cache.dtype))
            self.v_cache.index_copy_(2, positions, v.to(self.v_cache.dtype))
            furthest = (positions.max() + 1).expand(self.spec.batch_size)  # (B,)
        else:  # each row at its own positions
            rows = torch.arange(self.spec.batch_size, device=positions.device)[:, None]  # (B, 1)
            self.k_cache[rows, :, positions] = k.transpose(1, 2).to(self.k_cache.dtype)  # (B, T, H_kv, D)
            self.v_cache[rows, :, positions] = v.transpose(1, 2).to(self.v_cache.dtype)
            furthest = positions.max(dim=1).values + 1  # (B,)
        self.lengths.copy_(torch.maximum(self.lengths, furthest))
        return self.k_cache, self.v_cache, visible_keys(self.slots, positions)

    def kernel_buffers(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.k_cache, self.v_cache, self.lengths

    def reset(self) -> None:
        self.lengths.zero_()

    def truncate(self, length: int) -> None:
        self.lengths.clamp_(max=length)

    def contents(self) -> tuple[Tensor, Tensor]:
        end = self.length
        return self.k_cache[:, :, :end], self.v_cache[:, :, :end]

    @property
    def length(self) -> int:
        return int(self.lengths.max())

    @property
    def nbytes(self) -> int:
        return self.k_cache.numel() * self.k_cache.element_size() + (
            self.v_cache.numel() * self.v_cache.element_size()
        )

    def extra_repr(self) -> str:
        s = self.spec
        return f"batch={s.batch_size}, kv_heads={s.num_kv_heads}, capacity={s.capacity}, head_dim={s.head_dim}"


class SlotSelection:
    """Which slot rows the next calls carry, shared by every SlotKVCache of one session: the
    session sets it once per call (not once per layer).

    rows: (b,) the batch rows the calls carry (None: the whole batch). limit: with rows, how
    many positions attention reads (None: the capacity), so a short chat in a long-context
    slot does not read the whole slot every step."""

    __slots__ = ("rows", "limit", "span_mask")

    def __init__(self) -> None:
        self.rows: Tensor | None = None
        self.limit: int | None = None
        # The last one-row span's mask, keyed by (first position, T, S): every layer of a call
        # reads the same mask, built once (an elementwise pass over (T, S) per layer costs
        # milliseconds when torch's thread pool waits on a busy core).
        self.span_mask: tuple[tuple[int, int, int], Tensor] | None = None


class SlotKVCache(StaticKVCache):
    """A StaticKVCache whose rows are slots, one per request (a server's continuous batch).

    A whole-batch call writes every row, as in StaticKVCache. While the session's
    `SlotSelection` names rows (`DecodeSession.prefill_row`, `decode(..., rows=)`), a call
    carries only those rows, (b, H_kv, T, D): they are written at their own positions and
    attention reads those rows only, (b, H_kv, S, D), and only the first `limit` positions
    when it is set. So a new request is prefilled while the others keep what they hold, and
    a step decodes the occupied slots, not every slot of the batch. A freed row needs no
    clearing: its next request starts at position 0 and the position mask hides the rest.
    """

    def __init__(self, spec: CacheSpec, selection: SlotSelection | None = None) -> None:
        super().__init__(spec)
        self.selection = SlotSelection() if selection is None else selection

    @property
    def rows(self) -> Tensor | None:
        return self.selection.rows

    @property
    def limit(self) -> int | None:
        return self.selection.limit

    def kernel_rows(self) -> Tensor | None:
        return self.rows  # a call on some slots carries those rows (the whole batch without)

    def copy_row(self, source: int, target: int, length: int) -> None:
        """Slot `target` holds slot `source`'s first `length` positions (and nothing after)."""
        self.k_cache[target, :, :length] = self.k_cache[source, :, :length]  # (H_kv, length, D)
        self.v_cache[target, :, :length] = self.v_cache[source, :, :length]
        self.lengths[target] = length

    def _span_mask(self, first: int, t: int, end: int) -> Tensor:
        """visible_keys for positions [first, first + t) over slots [0, end), (1, 1, T, S),
        shared by every layer of the call (read only)."""
        key, held = (first, t, end), self.selection.span_mask
        if held is not None and held[0] == key:
            return held[1]
        mask = visible_keys(self.slots[:end], torch.arange(first, first + t, device=self.slots.device))
        self.selection.span_mask = (key, mask)
        return mask

    def update(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        rows = self.rows
        if rows is None:
            return super().update(k, v, positions)
        s, b = self.spec, rows.shape[0]
        t = k.shape[2] if k.dim() == 4 else -1
        if (k.dim() != 4 or k.shape[0] != b or v.shape[:3] != k.shape[:3]
                or positions.shape not in ((t,), (b, t))):
            raise ValueError(
                f"a call on {b} slot row(s) takes keys ({b}, {s.num_kv_heads}, T, {s.head_dim}) and "
                f"positions (T,) or ({b}, T), got keys {tuple(k.shape)} and positions {tuple(positions.shape)}"
            )
        if positions.dim() == 1:
            positions = positions.expand(b, t)  # (b, T)
        end = s.capacity if self.limit is None else min(self.limit, s.capacity)
        # (not while torch.compile traces: the test reads the positions' values, which would make
        # a graph per position; compiled steps keep the indexed write)
        span = None if torch.compiler.is_compiling() else _one_span(rows, positions)
        if span is not None:  # one row at consecutive positions (a prompt piece): slice copies, no gather
            row, first = span
            self.k_cache[row, :, first:first + t] = k[0].to(self.k_cache.dtype)  # (H_kv, T, D)
            self.v_cache[row, :, first:first + t] = v[0].to(self.v_cache.dtype)
            self.lengths[row] = first + t
            # contiguous (1, H_kv, S, D) copies, as index_select gives: the attention kernels read them dense
            keys, values = self.k_cache[row:row + 1, :, :end].clone(), self.v_cache[row:row + 1, :, :end].clone()
            return keys, values, self._span_mask(first, t, end)
        self.k_cache[rows[:, None], :, positions] = k.transpose(1, 2).to(self.k_cache.dtype)  # (b, T, H_kv, D)
        self.v_cache[rows[:, None], :, positions] = v.transpose(1, 2).to(self.v_cache.dtype)
        self.lengths[rows] = positions.max(dim=1).values + 1
        keys = self.k_cache[:, :, :end].index_select(0, rows)  # (b, H_kv, S, D), S = end
        values = self.v_cache[:, :, :end].index_select(0, rows)
        return keys, values, visible_keys(self.slots[:end], positions)  # (b, 1, T, S)


def _one_span(rows: Tensor, positions: Tensor) -> tuple[int, int] | None:
    """(row, first position) when a call carries one row at consecutive positions, (1, T),
    else None. An indexed write costs a gather per element; a slice copy is one memcpy per head."""
    if rows.shape[0] != 1 or positions.device.type != "cpu":
        return None
    first, t = int(positions[0, 0]), positions.shape[1]
    if t > 1 and not bool((positions[0, 1:] - positions[0, :-1] == 1).all()):
        return None
    return int(rows[0]), first

