"""Ring attention over torch.distributed: one sequence's attention shared by N processes.

Each of N ranks holds 1/N of a sequence's queries, keys and values (its *shard*). The
key/value blocks travel around a ring of point-to-point sends and receives: at step i,
rank r attends its own queries to the block that rank r - i holds, while the next block is
already on its way (`batch_isend_irecv`, overlapped with the block's computation). Each
block gives a partial context and the log-sum-exp of its scores; the partials are merged
exactly (the online softmax of flash attention), accumulating in float32:

    lse = logaddexp(lse_a, lse_b);  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

The backward pass runs the ring again: the key/value blocks travel once more, and with
each block the float32 gradient of its keys and values, which every rank adds to before
passing it on, so that after N steps each block's gradient is back home, complete.

Design choices:
- Shards are described by `ShardLayout`: *contiguous* (rank r holds the r-th of N pieces)
  or *zigzag* (the sequence cut into 2N chunks, rank r holds chunks r and 2N-1-r, so under
  a causal mask every rank has the same amount of work). Lengths need not divide by N:
  pieces differ by at most one token, and every rank knows every shard's length, so each
  receive is allocated at its exact size. Tokens keep their global positions (for RoPE).
- Causal attention works on global positions: a key block entirely in a query range's
  future is skipped, one entirely in its past is attended without a mask, and only a
  block that overlaps the diagonal is masked.
- Grouped-query attention sends only the H_kv key/value heads. The G = H / H_kv query heads
  of a group are stacked as G x T rows against their one key/value head, so no block is
  ever repeated to H heads.
- Blocks run on PyTorch's CPU flash kernel (`aten._scaled_dot_product_flash_attention_for_cpu`,
  which returns the log-sum-exp, and its backward, which takes the merged output and
  log-sum-exp and so gives each block's exact share of the gradients) or, on other
  devices, an explicit float32 computation of the same quantities.
- With N = 1 there is no communication and no process group is needed.
- Every wait on a send or receive has a timeout, so a missing peer is an error, not a hang.

Shape legend: B batch, H query heads, H_kv key/value heads, G = H / H_kv query heads per
key/value head, T this rank's query tokens, S the key tokens of one block, D head size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from qkv.attention.shard_layout import SHARDINGS, Range, ShardLayout, Sharding  # noqa: F401  (re-exported)
from qkv.errors import QkvError

# How a block is computed: "flash" = PyTorch's CPU flash kernel (CPU tensors only),
# "explicit" = float32 matrix products (any device), "auto" = flash on CPU, else explicit.
BlockKernel = Literal["auto", "flash", "explicit"]
DEFAULT_TIMEOUT = timedelta(seconds=120)

@dataclass
class RingStats:
    """What the ring moved and held on this rank (bytes), across forward and backward."""

    bytes_sent: int = 0
    peak_kv_bytes: int = 0  # keys/values alive at once: own shard, current block, incoming block
    kv_heads: int = 0


@dataclass(frozen=True)
class Ring:
    """One rank's place in a ring over `group` for one sequence layout.

    `group` may be None only for a one-process layout. The group's size must equal the
    layout's world size, and `rank` is this process's rank within the group.
    """

    layout: ShardLayout
    rank: int = 0
    group: dist.ProcessGroup | None = None
    timeout: timedelta = DEFAULT_TIMEOUT
    kernel: BlockKernel = "auto"
    stats: RingStats = field(default_factory=RingStats, compare=False)

    def __post_init__(self) -> None:
        n = self.layout.world_size
        if n > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise QkvError(
                    f"ring attention over {n} processes needs an initialised torch.distributed "
                    "process group (run under torchrun, or call torch.distributed.init_process_group)"
                )
            size = dist.get_world_size(self.group)
            if size != n:
                raise QkvError(
                    f"mismatched world sizes: the sequence is sharded over {n} processes but the "
                    f"process group has {size}"
                )
        if self.kernel not in ("auto", "flash", "explicit"):
            raise ValueError(f"unknown block kernel {self.kernel!r}; choose auto, flash or explicit")
        if not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} is outside a ring of {n} processes")

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def uses_flash(self, device: torch.device) -> bool:
        return self.kernel == "flash" or (self.kernel == "auto" and device.type == "cpu")

    def peer(self, offset: int) -> int:
        """The global rank of the process `offset` places further along the ring."""
        local = (self.rank + offset) % self.world_size
        return local if self.group is None else dist.get_global_rank(self.group, local)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
        dropout_p: float = 0.0,
        backend: str = "fused",
    ) -> Tensor:
        """The attention layers' entry point, with `qkv.attention.attention`'s signature so a
        layer calls either one the same way: rejects what a ring cannot do, then rings.
        `backend` picks nothing here; the ring's blocks run on `self.kernel`."""
        if mask is not None:
            raise ValueError("ring attention takes no mask (padding masks are not sharded); pass mask=None")
        if dropout_p > 0.0:
            raise ValueError(f"ring attention has no attention dropout; got dropout_p={dropout_p}")
        return ring_attention(q, k, v, self, is_causal=is_causal, scale=scale)


def ring_for(
    seq_len: int,
    *,
    group: dist.ProcessGroup | None = None,
    sharding: Sharding = "contiguous",
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> Ring:
    """The ring of this process over `group` (the default group when None) for `seq_len`
    tokens; one process alone when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        n, rank = dist.get_world_size(group), dist.get_rank(group)
    else:
        n, rank = 1, 0
    return Ring(ShardLayout(seq_len, n, sharding), rank, group if n > 1 else None, timeout)


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, ring: Ring, *, is_causal: bool = False, scale: float | None = None
) -> Tensor:
    """Attention of this rank's queries (B, H, T, D) to the keys/values (B, H_kv, T, D) of
    every rank, the sequence laid out by `ring.layout`. Returns this rank's (B, H, T, D)
    context, equal to the matching rows of single-process attention over the whole sequence.
    Differentiable with respect to q, k and v."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"ring attention takes (B, H, T, D) tensors; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    local = ring.layout.length(ring.rank)
    if q.shape[2] != local or k.shape[2] != local or v.shape[2] != local:
        raise ValueError(
            f"rank {ring.rank} holds {local} tokens of the sequence, but got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[1] % k.shape[1] != 0 or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"keys and values must match and their heads divide the query heads; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, ring, is_causal, scale)


# -- the plan of one step: which query rows meet which key columns, masked or not -------------


@dataclass(frozen=True)
class _Piece:
    rows: slice  # of this rank's T queries
    cols: slice  # of the block's S keys
    q_start: int  # global position of rows.start (its range is contiguous in positions)
    k_start: int  # global position of cols.start
    masked: bool  # the piece straddles the diagonal: key j visible to query i iff j <= i


def _with_offsets(ranges: tuple[Range, ...]) -> list[tuple[int, Range]]:
    out, offset = [], 0
    for r in ranges:
        out.append((offset, r))
        offset += r[1] - r[0]
    return out


def _plan(q_ranges: tuple[Range, ...], k_ranges: tuple[Range, ...], causal: bool) -> list[_Piece]:
    """The pieces of attention between this rank's queries and one block of keys.

    Without causality, one piece: everything. With it, each (query range, key range) pair is
    skipped (keys all in the future), full (keys all in the past or present) or masked (it
    straddles the diagonal). Full neighbouring key ranges merge into one piece, and so do
    neighbouring query ranges that see the same keys, so the common cases are one or two
    kernel calls per step.
    """
    q_total = sum(e - s for s, e in q_ranges)
    k_total = sum(e - s for s, e in k_ranges)
    if not causal:
        return [_Piece(slice(0, q_total), slice(0, k_total), -1, -1, False)]
    per_row: list[tuple[int, Range, list[_Piece]]] = []
    for q_off, (qs, qe) in _with_offsets(q_ranges):
        pieces: list[_Piece] = []
        for k_off, (ks, ke) in _with_offsets(k_ranges):
            cols = slice(k_off, k_off + ke - ks)
            rows = slice(q_off, q_off + qe - qs)
            if ks > qe - 1:
                continue  # every key after every query: nothing to see
            masked = ke - 1 > qs  # some key lies after some query
            last = pieces[-1] if pieces else None
            if not masked and last is not None and not last.masked and last.cols.stop == cols.start:
                pieces[-1] = _Piece(rows, slice(last.cols.start, cols.stop), qs, last.k_start, False)
            else:
                pieces.append(_Piece(rows, cols, qs, ks, masked))
        per_row.append((q_off, (qs, qe), pieces))
    merged: list[_Piece] = []
    previous: list[_Piece] | None = None
    for _, _, pieces in per_row:
        same_keys = (
            previous is not None
            and len(pieces) == len(previous)
            and all(not a.masked and not b.masked and a.cols == b.cols for a, b in zip(pieces, previous))
            and all(a.rows.stop == b.rows.start for a, b in zip(previous, pieces))
        )
        if same_keys and previous is not None:
            count = len(pieces)
            widened = [
                _Piece(slice(p.rows.start, n.rows.stop), p.cols, p.q_start, p.k_start, False)
                for p, n in zip(previous, pieces)
            ]
            merged[-count:] = widened
            previous = widened
        else:
            merged.extend(pieces)
            previous = pieces
    return merged


# -- one block: forward gives (out, lse), backward gives its share of the gradients ------------


def _piece_mask(piece: _Piece, rows: int, cols: int, groups: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(G*t, s) additive mask of a piece on the diagonal: -inf where the key is in the future."""
    q_pos = torch.arange(piece.q_start, piece.q_start + rows, device=device)  # (t,)
    k_pos = torch.arange(piece.k_start, piece.k_start + cols, device=device)  # (s,)
    future = k_pos[None, :] > q_pos[:, None]  # (t, s)
    mask = torch.zeros(rows, cols, dtype=dtype, device=device).masked_fill_(future, -torch.inf)
    return mask.repeat(groups, 1)  # (G*t, s): the same for each query head of a group


def _square_causal(piece: _Piece, rows: int, cols: int) -> bool:
    return piece.masked and piece.q_start == piece.k_start and rows == cols


def _explicit_scores(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, scale: float) -> Tensor:
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale  # (B, H_kv, G*t, s)
    if mask is not None:
        scores = scores + mask.float()
    elif causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu_(1), -torch.inf)
    return scores


def _block_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float, flash: bool
) -> tuple[Tensor, Tensor]:
    """q (B, H_kv, G*t, D), k/v (B, H_kv, s, D) -> out (B, H_kv, G*t, D), lse float32 (B, H_kv, G*t)."""
    if flash:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
    scores = _explicit_scores(q, k, mask, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)  # (B, H_kv, G*t)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.float()  # (B, H_kv, G*t, D)
    return out, lse


def _block_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    mask: Tensor | None, causal: bool, scale: float, flash: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The block's share of dq (B, H_kv, G*t, D), dk and dv (B, H_kv, s, D), given the
    merged output and log-sum-exp of the whole row (so the shares add up exactly)."""
    if flash:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )
    probs = torch.exp(_explicit_scores(q, k, mask, causal, scale) - lse.unsqueeze(-1))  # (B, H_kv, G*t, s)
    dout32 = dout.float()
    dv = probs.transpose(-2, -1) @ dout32  # (B, H_kv, s, D)
    dprobs = dout32 @ v.float().transpose(-2, -1)  # (B, H_kv, G*t, s)
    delta = (dout32 * out.float()).sum(dim=-1, keepdim=True)  # (B, H_kv, G*t, 1)
    dscores = probs * (dprobs - delta) * scale
    return dscores @ k.float(), dscores.transpose(-2, -1) @ q.float(), dv


def _grouped_rows(x: Tensor, rows: slice) -> Tensor:
    """(B, H_kv, G, T, ...) -> the rows' (B, H_kv, G*t, ...), query heads of a group stacked."""
    part = x[:, :, :, rows]  # (B, H_kv, G, t, ...)
    return part.reshape(part.shape[0], part.shape[1], -1, *part.shape[4:])  # (B, H_kv, G*t, ...)


# -- the ring's transport ---------------------------------------------------------------------


class _Exchange:
    """Send tensors to the next rank and receive same-shaped ones from the previous rank,
    without waiting; `wait()` returns what arrived (or raises after the ring's timeout)."""

    def __init__(self, ring: Ring, send: list[Tensor], recv_shapes: list[torch.Size], dtypes: list[torch.dtype], tag: int) -> None:
        self.ring = ring
        self.received = [torch.empty(s, dtype=d, device=send[0].device) for s, d in zip(recv_shapes, dtypes)]
        nxt, prev = ring.peer(1), ring.peer(-1)
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, ring.group, tag + i) for i, t in enumerate(send)]
        ops += [dist.P2POp(dist.irecv, t, prev, ring.group, tag + i) for i, t in enumerate(self.received)]
        self.works = dist.batch_isend_irecv(ops)
        ring.stats.bytes_sent += sum(t.numel() * t.element_size() for t in send)

    def wait(self) -> list[Tensor]:
        for work in self.works:
            try:
                finished = work.wait(self.ring.timeout)
            except RuntimeError as error:
                raise QkvError(
                    f"ring attention: rank {self.ring.rank} got no block from its neighbour within "
                    f"{self.ring.timeout.total_seconds():.0f} s ({str(error).splitlines()[0]})"
                ) from None
            if finished is False:
                raise QkvError(
                    f"ring attention: rank {self.ring.rank} timed out after "
                    f"{self.ring.timeout.total_seconds():.0f} s waiting for its neighbour"
                )
        return self.received


def _block_shape(k: Tensor, tokens: int) -> torch.Size:
    return torch.Size((k.shape[0], k.shape[1], tokens, k.shape[3]))


def _note_kv(ring: Ring, *tensors: Tensor) -> None:
    held = sum(t.numel() * t.element_size() for t in tensors)
    ring.stats.peak_kv_bytes = max(ring.stats.peak_kv_bytes, held)


# -- the autograd function ----------------------------------------------------------------------


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ring: Ring, causal: bool, scale: float) -> Tensor:  # type: ignore[override]
        out, lse = _ring_forward(q, k, v, ring, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.scale = ring, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.ring, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, ring: Ring, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    b, h, t, d = q.shape
    h_kv = k.shape[1]
    groups = h // h_kv
    n, rank, layout = ring.world_size, ring.rank, ring.layout
    ring.stats.kv_heads = h_kv
    _note_kv(ring, k, v)
    q5 = q.reshape(b, h_kv, groups, t, d)  # (B, H_kv, G, T, D)
    out = torch.zeros(b, h_kv, groups, t, d, dtype=torch.float32, device=q.device)  # (B, H_kv, G, T, D)
    lse = torch.full((b, h_kv, groups, t), -torch.inf, dtype=torch.float32, device=q.device)  # (B, H_kv, G, T)
    my_ranges = layout.ranges(rank)
    block_k, block_v = k, v
    for step in range(n):
        source = (rank - step) % n
        incoming = None
        if step < n - 1:
            shape = _block_shape(k, layout.length((rank - step - 1) % n))
            incoming = _Exchange(ring, [block_k, block_v], [shape, shape], [k.dtype, v.dtype], tag=0)
            _note_kv(ring, k, v, *([] if step == 0 else [block_k, block_v]), *incoming.received)
        for piece in _plan(my_ranges, layout.ranges(source), causal):
            rows = piece.rows.stop - piece.rows.start
            cols = piece.cols.stop - piece.cols.start
            square = _square_causal(piece, rows, cols) and groups == 1
            mask = (
                _piece_mask(piece, rows, cols, groups, q.dtype, q.device)
                if piece.masked and not square else None
            )
            part_out, part_lse = _block_forward(
                _grouped_rows(q5, piece.rows), block_k[:, :, piece.cols], block_v[:, :, piece.cols],
                mask, square, scale, ring.uses_flash(q.device),
            )  # (B, H_kv, G*t, D), (B, H_kv, G*t)
            acc_out, acc_lse = out[:, :, :, piece.rows], lse[:, :, :, piece.rows]  # views
            part_out = part_out.float().view(b, h_kv, groups, rows, d)  # (B, H_kv, G, t, D)
            part_lse = part_lse.view(b, h_kv, groups, rows)  # (B, H_kv, G, t)
            merged = torch.logaddexp(acc_lse, part_lse)
            acc_out.mul_(torch.exp(acc_lse - merged).unsqueeze(-1))
            acc_out.add_(part_out * torch.exp(part_lse - merged).unsqueeze(-1))
            acc_lse.copy_(merged)
        if incoming is not None:
            block_k, block_v = incoming.wait()
    return out.to(q.dtype).view(b, h, t, d), lse.view(b, h, t)  # (B, H, T, D), (B, H, T)


def _ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    ring: Ring, causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    b, h, t, d = q.shape
    h_kv = k.shape[1]
    groups = h // h_kv
    n, rank, layout = ring.world_size, ring.rank, ring.layout
    q5 = q.reshape(b, h_kv, groups, t, d)  # (B, H_kv, G, T, D)
    dout5 = dout.contiguous().view(b, h_kv, groups, t, d)  # (B, H_kv, G, T, D)
    out5 = out.view(b, h_kv, groups, t, d)  # (B, H_kv, G, T, D)
    lse4 = lse.view(b, h_kv, groups, t)  # (B, H_kv, G, T)
    dq = torch.zeros(b, h_kv, groups, t, d, dtype=torch.float32, device=q.device)  # (B, H_kv, G, T, D)
    my_ranges = layout.ranges(rank)
    block_k, block_v = k, v
    pending: _Exchange | None = None  # the block's gradient so far, coming from the previous rank
    for step in range(n):
        source = (rank - step) % n
        incoming = None
        if step < n - 1:
            shape = _block_shape(k, layout.length((rank - step - 1) % n))
            incoming = _Exchange(ring, [block_k, block_v], [shape, shape], [k.dtype, v.dtype], tag=0)
            _note_kv(ring, k, v, *([] if step == 0 else [block_k, block_v]), *incoming.received)
        dk_block = torch.zeros(block_k.shape, dtype=torch.float32, device=k.device)  # (B, H_kv, S, D)
        dv_block = torch.zeros(block_v.shape, dtype=torch.float32, device=v.device)  # (B, H_kv, S, D)
        for piece in _plan(my_ranges, layout.ranges(source), causal):
            rows = piece.rows.stop - piece.rows.start
            cols = piece.cols.stop - piece.cols.start
            square = _square_causal(piece, rows, cols) and groups == 1
            mask = (
                _piece_mask(piece, rows, cols, groups, q.dtype, q.device)
                if piece.masked and not square else None
            )
            gq, gk, gv = _block_backward(
                _grouped_rows(dout5, piece.rows), _grouped_rows(q5, piece.rows),
                block_k[:, :, piece.cols], block_v[:, :, piece.cols],
                _grouped_rows(out5, piece.rows), _grouped_rows(lse4, piece.rows), mask, square, scale,
                ring.uses_flash(q.device),
            )
            dq[:, :, :, piece.rows] += gq.float().view(b, h_kv, groups, rows, d)
            dk_block[:, :, piece.cols] += gk.float()
            dv_block[:, :, piece.cols] += gv.float()
        if pending is not None:  # waited for only now: it travelled while this block computed
            so_far_k, so_far_v = pending.wait()
            dk_block += so_far_k
            dv_block += so_far_v
        if n > 1:
            shape = _block_shape(k, layout.length((rank - step - 1) % n))
            pending = _Exchange(ring, [dk_block, dv_block], [shape, shape], [torch.float32] * 2, tag=2)
        if incoming is not None:
            block_k, block_v = incoming.wait()
    if pending is not None:
        dk_block, dv_block = pending.wait()  # this rank's own block, with every rank's share
    dq_out = dq.view(b, h, t, d).to(q.dtype)  # (B, H, T, D)
    return dq_out, dk_block.to(k.dtype), dv_block.to(v.dtype)
