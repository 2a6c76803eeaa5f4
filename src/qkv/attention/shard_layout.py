"""How a sequence is split between the ranks of a ring (context parallelism).

"contiguous" gives rank r the r-th of `world_size` equal runs of tokens; "zigzag" cuts the
sequence into 2 x world_size chunks and gives rank r chunks r and 2 x world_size - 1 - r, so
that under a causal mask every rank has about the same work (qkv.attention.ring).

Shape legend: T tokens of the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from qkv.errors import QkvError

Sharding = Literal["contiguous", "zigzag"]
SHARDINGS: tuple[str, ...] = ("contiguous", "zigzag")

Range = tuple[int, int]  # [start, end) of global token positions


@dataclass(frozen=True)
class ShardLayout:
    """Which global token positions each of `world_size` ranks holds, and in what order."""

    seq_len: int
    world_size: int
    sharding: Sharding = "contiguous"

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"unknown sharding {self.sharding!r}; choose one of {', '.join(SHARDINGS)}")
        if self.world_size < 1:
            raise ValueError(f"a ring needs at least one process, got {self.world_size}")
        if self.seq_len < self.world_size:
            raise QkvError(
                f"a sequence of {self.seq_len} tokens cannot be shared by {self.world_size} "
                f"processes (each needs at least one token); use fewer processes or a longer sequence"
            )

    def _chunks(self) -> list[Range]:
        pieces = self.world_size if self.sharding == "contiguous" else 2 * self.world_size
        base, extra = divmod(self.seq_len, pieces)
        bounds, start = [], 0
        for i in range(pieces):
            end = start + base + (1 if i < extra else 0)
            bounds.append((start, end))
            start = end
        return bounds

    def ranges(self, rank: int) -> tuple[Range, ...]:
        """The non-empty ranges of global positions that `rank` holds, in its local order."""
        chunks = self._chunks()
        if self.sharding == "contiguous":
            held = [chunks[rank]]
        else:
            held = [chunks[rank], chunks[2 * self.world_size - 1 - rank]]
        return tuple(r for r in held if r[1] > r[0])

    def length(self, rank: int) -> int:
        return sum(end - start for start, end in self.ranges(rank))

    def positions(self, rank: int, device: torch.device | str | None = None) -> Tensor:
        """(T,) global positions of `rank`'s tokens, in its local order."""
        return torch.cat([torch.arange(s, e, device=device) for s, e in self.ranges(rank)])

    def shard(self, x: Tensor, rank: int, dim: int) -> Tensor:
        """`rank`'s part of a whole sequence laid out along `dim`."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"expected {self.seq_len} tokens on dim {dim}, got shape {tuple(x.shape)}")
        return torch.cat([x.narrow(dim, s, e - s) for s, e in self.ranges(rank)], dim=dim)

    def unshard(self, shards: list[Tensor], dim: int) -> Tensor:
        """The whole sequence from every rank's shard (in rank order) along `dim`."""
        pieces: list[tuple[int, Tensor]] = []
        for rank, part in enumerate(shards):
            offset = 0
            for s, e in self.ranges(rank):
                pieces.append((s, part.narrow(dim, offset, e - s)))
                offset += e - s
        return torch.cat([p for _, p in sorted(pieces, key=lambda item: item[0])], dim=dim)
