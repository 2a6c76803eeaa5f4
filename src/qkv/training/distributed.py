"""One process or many: the torch.distributed context of a training run.

Under `torchrun` the environment holds RANK, WORLD_SIZE and LOCAL_RANK; the run then
joins a process group (gloo on CPU, nccl on GPU) and wraps the model in
DistributedDataParallel. Without them it is a plain single process. Only rank 0 logs
and writes files.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_mean(self, value: float) -> float:
        """Mean of a float over all processes (the value itself when alone)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.world_size

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            values = values.to(self.device)
            dist.all_reduce(values)
        return values

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (on every rank)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def init_distributed(*, group_even_alone: bool = False, timeout: timedelta | None = None) -> DistContext:
    """Join the process group that torchrun describes, or run alone. With
    `group_even_alone` a one-process torchrun launch joins a group of one too (context
    parallelism wants a group whatever its size); `timeout` bounds every collective."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if (world_size > 1 or group_even_alone) and not dist.is_initialized():
        extra = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", **extra)
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def shutdown_distributed(ctx: DistContext) -> None:
    """Leave the process group. Drop every DDP wrapper first: a reducer that outlives the
    group destroys it from its own destructor, which holds the GIL while joining gloo's
    worker threads, and a worker still releasing a collective's tensors waits for that GIL:
    a deadlock (seen about 1 run in 4 on a loaded 2-core machine). The group's own
    destructor, reached here through destroy_process_group, releases the GIL first."""
    if ctx.distributed and dist.is_initialized():
        gc.collect()  # a DDP wrapper caught in a reference cycle goes now, not later
        dist.destroy_process_group()
