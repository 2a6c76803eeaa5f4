"""The process group a tensor-parallel model talks over, and the checks made before it loads.

Every collective a rank makes goes through `TensorParallel`: an all-reduce after attention and
one after the MLP (sums of the ranks' partial products), one after the embedding lookup, and
an all-gather of the output head's vocabulary stretches (and, under `qkv serve`, the broadcast
of rank 0's step plans: qkv.runtime.tensor_parallel_steps). Each is bounded by the group's timeout,
and a peer that died or stopped answering becomes one `RankLost` line (a QkvError) instead
of a hang or a backend traceback.

Before anything loads, `join_tensor_parallel` checks that torchrun started as many processes as
asked, and `check_same_files` that every rank opened the same bytes (content digests, remembered
per file version by qkv.util.digest_memo, compared across ranks). `shared_seed` gives every rank
rank 0's seed: the gathered logits are the same bytes on every rank, so the same seed samples
the same tokens everywhere with no collective per token.

Shape legend: B batch, T tokens, C hidden size, V vocabulary, N ranks.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from qkv.errors import QkvError
from qkv.util.digest_memo import remembered_digest

DEFAULT_TIMEOUT = timedelta(seconds=120)


class RankLost(QkvError):
    """Another rank died or did not answer within the timeout."""


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group (group None: one process, no collective)."""

    rank: int = 0
    world: int = 1
    group: dist.ProcessGroup | None = None
    timeout: timedelta = DEFAULT_TIMEOUT

    def _lost(self, what: str, error: BaseException) -> RankLost:
        reason = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
        return RankLost(f"rank {self.rank} of {self.world}: another rank stopped or did not answer within "
                        f"{self.timeout.total_seconds():.0f} s during the {what} ({reason}); stopping")

    def all_reduce(self, x: Tensor, what: str = "all-reduce") -> Tensor:
        """The sum of every rank's `x` (in place, and returned)."""
        if self.group is None:
            return x
        try:
            dist.all_reduce(x, group=self.group)
        except (RuntimeError, ValueError) as error:  # gloo/nccl report a dead peer or a timeout so
            raise self._lost(what, error) from None
        return x

    def broadcast(self, x: Tensor, what: str = "broadcast") -> Tensor:
        """Rank 0's `x` on every rank (in place, and returned)."""
        if self.group is None:
            return x
        try:
            dist.broadcast(x, src=0, group=self.group)
        except (RuntimeError, ValueError) as error:
            raise self._lost(what, error) from None
        return x

    def all_gather(self, x: Tensor, what: str = "all-gather") -> list[Tensor]:
        """Every rank's `x` (all the same shape), in rank order."""
        if self.group is None:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.world)]
        try:
            dist.all_gather(parts, x.contiguous(), group=self.group)
        except (RuntimeError, ValueError) as error:
            raise self._lost(what, error) from None
        return parts

    def barrier(self) -> None:
        if self.group is not None:
            try:
                dist.barrier(group=self.group)
            except (RuntimeError, ValueError) as error:
                raise self._lost("final barrier", error) from None

    def gather_objects(self, obj: object, what: str) -> list[object]:
        if self.group is None:
            return [obj]
        out: list[object] = [None] * self.world
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except (RuntimeError, ValueError) as error:
            raise self._lost(what, error) from None
        return out


def join_tensor_parallel(world: int, *, timeout: timedelta = DEFAULT_TIMEOUT) -> TensorParallel:
    """Join the group torchrun describes (gloo on CPU, nccl where CUDA is), as one of `world`
    ranks; QkvError without torchrun or when it started another number of processes."""
    started = os.environ.get("WORLD_SIZE")
    if started is None:
        if world == 1:
            return TensorParallel(timeout=timeout)
        raise QkvError(f"--tensor-parallel {world} needs {world} processes: run "
                       f"`torchrun --nproc-per-node {world} -m qkv ... --tensor-parallel {world}`")
    if int(started) != world:
        raise QkvError(f"mismatched world sizes: asked for --tensor-parallel {world} but torchrun started "
                       f"{started} processes (torchrun --nproc-per-node {world}, or --nnodes x --nproc-per-node = {world})")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timeout)
    return TensorParallel(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, timeout)


def check_same_files(tp: TensorParallel, files: Iterable[Path], memo: Path) -> str:
    """The files' content digest, the same on every rank (else QkvError naming the ranks that differ)."""
    paths = list(files)
    try:
        digest = remembered_digest(paths, memo)
    except OSError as error:
        raise QkvError(f"cannot read {paths[0] if paths else 'the model'} to check it: {error}") from None
    digests = tp.gather_objects(digest, "check that every rank opened the same file")
    odd = [rank for rank, d in enumerate(digests) if d != digests[0]]
    if odd:
        who = f"rank {odd[0]}" if len(odd) == 1 else "ranks " + ", ".join(str(r) for r in odd)
        raise QkvError(f"{who} opened a model file whose bytes differ from rank 0's (content digest "
                       f"{str(digests[odd[0]])[:12]}... against {str(digests[0])[:12]}...); give every rank the same file")
    return digest


def shared_seed(tp: TensorParallel, seed: int | None) -> int | None:
    """Rank 0's seed on every rank; with none given, rank 0 draws one (module docstring)."""
    if tp.group is None:
        return seed
    drawn = seed if seed is not None else secrets.randbelow(2**63)
    return int(tp.gather_objects(drawn, "agreement on the sampling seed")[0])  # type: ignore[arg-type]
