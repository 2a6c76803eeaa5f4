"""Training data as the book builds it: a 90/10 character split, sliding token windows.

A window starting at token i is the input ids[i : i + L] and the target ids[i+1 : i+L+1]
(the next token at every position). Windows start every `stride` tokens; the book
trains with stride = L (no overlap). Each epoch shuffles the training windows with a
generator seeded by (seed, epoch), so the order is a function of the data position
alone and a resumed run sees exactly the batches it would have seen.

Distributed sharding keeps the global batch of a run equal whatever the number of
processes: global batch k is perm[k*G : (k+1)*G] with G = batch x world size, and rank r
takes the contiguous slice [r*batch : (r+1)*batch] of it.

Shape legend: N windows, B batch (per process), L window length (tokens).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.util.text_file import read_text_file

TRAIN_RATIO = 0.90  # the book's split


def read_text(path: str | Path) -> str:
    return read_text_file(path, when_empty="is empty; give --data a file with some text")


def text_fingerprint(text: str) -> str:
    """A short hash so a resumed run can check it trains on the same data."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def split_text(text: str, train_ratio: float = TRAIN_RATIO) -> tuple[str, str]:
    """The book's split: the first 90% of the characters train, the rest validate."""
    cut = int(train_ratio * len(text))
    return text[:cut], text[cut:]


class TokenWindows:
    """Sliding (input, target) windows over one token sequence."""

    def __init__(self, ids: list[int] | Tensor, length: int, stride: int) -> None:
        self.ids = torch.as_tensor(ids, dtype=torch.long)  # (tokens,)
        self.length = length
        self.stride = stride
        if self.ids.numel() < length + 1:
            self.windows = self.ids.new_empty((0, length + 1))
        else:
            self.windows = self.ids.unfold(0, length + 1, stride)  # (N, L + 1), a view

    def __len__(self) -> int:
        return self.windows.shape[0]

    def batch(self, index: Tensor) -> tuple[Tensor, Tensor]:
        rows = self.windows[index]  # (B, L + 1)
        return rows[:, :-1], rows[:, 1:]  # inputs (B, L), targets (B, L)


def require_windows(windows: TokenWindows, split: str, tokens: int) -> None:
    if len(windows) == 0:
        raise QkvError(
            f"the {split} split has {tokens} tokens, fewer than one window of "
            f"{windows.length + 1}; use more text or a smaller --context-length"
        )


@dataclass(frozen=True)
class BatchSchedule:
    """Which training windows each process reads at every step."""

    num_windows: int
    batch_size: int  # per process
    world_size: int
    seed: int

    def __post_init__(self) -> None:
        if self.steps_per_epoch == 0:
            raise QkvError(
                f"the training split has {self.num_windows} windows, fewer than one global "
                f"batch of {self.global_batch}; lower --batch-size or --context-length or "
                "--stride, or use more text"
            )

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_windows // self.global_batch  # the book drops the last partial batch

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of a 0-based global step."""
        return divmod(step, self.steps_per_epoch)

    def permutation(self, epoch: int) -> Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_windows, generator=generator)  # (N,)

    def indices(self, step: int, rank: int, permutation: Tensor | None = None) -> Tensor:
        """Window indices that `rank` trains on at `step` (permutation: this epoch's)."""
        epoch, k = self.position(step)
        perm = self.permutation(epoch) if permutation is None else permutation
        start = k * self.global_batch + rank * self.batch_size
        return perm[start : start + self.batch_size]  # (B,)
