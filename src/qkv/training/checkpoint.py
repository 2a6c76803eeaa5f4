"""Training checkpoints: one safetensors file with tensors, and JSON for everything else.

`checkpoint.safetensors` in the output folder holds the model weights (`model.*`), the
optimizer's per-parameter tensors (`optimizer.<param>.<key>`) and every process's RNG
state (`rng.cpu.<rank>`, `rng.cuda.<rank>`); its metadata holds one JSON document with
the step, the data position, the run's settings, the optimizer's parameter groups and
the scheduler's state. Being one file, it is replaced atomically: a crash or Ctrl-C
during a save leaves the previous checkpoint whole. Loading never unpickles anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.atomic import atomic_write_bytes

CHECKPOINT_NAME = "checkpoint.safetensors"
FORMAT = "qkv-training-checkpoint/1"
_META_KEY = "qkv_training"


@dataclass
class TrainingState:
    """Where a run stands: what a checkpoint saves besides the tensors' owners."""

    step: int  # optimizer steps done
    tokens_seen: int
    epoch: int
    batch_in_epoch: int
    world_size: int
    settings: dict[str, Any]
    model_config: dict[str, Any]
    data_fingerprint: str


@dataclass
class Checkpoint:
    state: TrainingState
    model: dict[str, Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng_cpu: list[Tensor]
    rng_cuda: list[Tensor | None]


def checkpoint_path(out: str | Path) -> Path:
    return Path(out) / CHECKPOINT_NAME


def save_checkpoint(
    path: str | Path,
    *,
    state: TrainingState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rng_cpu: list[Tensor],
    rng_cuda: list[Tensor | None],
) -> None:
    tensors: dict[str, Tensor] = {
        f"model.{k}": v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()
    }
    opt = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for index, entries in opt["state"].items():
        for key, value in entries.items():
            if isinstance(value, Tensor):
                tensors[f"optimizer.{index}.{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    for rank, rng in enumerate(rng_cpu):
        tensors[f"rng.cpu.{rank}"] = rng.contiguous()
    for rank, rng in enumerate(rng_cuda):
        if rng is not None:
            tensors[f"rng.cuda.{rank}"] = rng.to("cpu").contiguous()
    meta = {
        "format": FORMAT,
        "state": state.__dict__,
        "optimizer": {"param_groups": opt["param_groups"], "scalars": scalars},
        "scheduler": scheduler.state_dict(),
    }
    blob = safetensors_bytes(tensors, metadata={_META_KEY: json.dumps(meta)})
    atomic_write_bytes(path, blob)


def _read(p: Path, *, with_tensors: bool) -> tuple[dict[str, Any], TrainingState, dict[str, Tensor]]:
    if not p.is_file():
        raise QkvError(f"no training checkpoint at {p}; run without --resume to start a new run")
    try:
        with safe_open(str(p), framework="pt", device="cpu") as handle:
            meta = json.loads((handle.metadata() or {})[_META_KEY])
            tensors = {key: handle.get_tensor(key) for key in handle.keys()} if with_tensors else {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        return meta, TrainingState(**meta["state"]), tensors
    except Exception as error:  # safetensors, JSON and key errors all mean a bad file
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise QkvError(
            f"checkpoint {p} is corrupt or not a qkv training checkpoint ({reason}); "
            "restore it or start a new run in another --out folder"
        ) from None


def read_state(path: str | Path) -> TrainingState:
    """Only the checkpoint's JSON part (cheap: no tensor is read)."""
    return _read(Path(path), with_tensors=False)[1]


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint; anything unreadable or incomplete is a QkvError naming the file."""
    p = Path(path)
    meta, state, tensors = _read(p, with_tensors=True)

    model = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    opt_state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            opt_state.setdefault(int(index), {})[name] = value
    for index, entries in meta["optimizer"]["scalars"].items():
        opt_state.setdefault(int(index), {}).update(entries)
    groups = meta["optimizer"]["param_groups"]
    for group in groups:
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    world = state.world_size
    try:
        rng_cpu = [tensors[f"rng.cpu.{r}"] for r in range(world)]
    except KeyError as missing:
        raise QkvError(f"checkpoint {p} lacks the RNG state {missing}; it is incomplete") from None
    rng_cuda = [tensors.get(f"rng.cuda.{r}") for r in range(world)]
    return Checkpoint(
        state=state,
        model=model,
        optimizer={"state": opt_state, "param_groups": groups},
        scheduler=meta["scheduler"],
        rng_cpu=rng_cpu,
        rng_cuda=rng_cuda,
    )


def restore_modules(
    checkpoint: Checkpoint,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    path: str | Path,
) -> None:
    """Load the checkpoint's weights and optimizer/scheduler state, naming any mismatch."""
    expected = set(model.state_dict())
    missing, unknown = expected - set(checkpoint.model), set(checkpoint.model) - expected
    if missing or unknown:
        raise QkvError(
            f"checkpoint {path} does not match the model: missing {sorted(missing)[:3]}, "
            f"unknown {sorted(unknown)[:3]}"
        )
    try:
        model.load_state_dict(checkpoint.model, strict=True)
        optimizer.load_state_dict(checkpoint.optimizer)
    except (RuntimeError, ValueError, KeyError) as error:
        first = str(error).splitlines()[0]
        raise QkvError(f"checkpoint {path} does not fit this model ({first})") from None
    scheduler.load_state_dict(checkpoint.scheduler)
