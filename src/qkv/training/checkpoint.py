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
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.util.atomic import atomic_write_bytes

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
            raise ValueError(f"format {str(meta.get('format'))[:40]!r}, expected {FORMAT!r}")
        state = TrainingState(**meta["state"])
        _check_meta(meta, state)
        return meta, state, tensors
    except Exception as error:  # safetensors, JSON, key and type errors all mean a bad file
        reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        raise QkvError(
            f"checkpoint {p} is corrupt or not a qkv training checkpoint ({reason}); "
            "restore it or start a new run in another --out folder"
        ) from None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check_meta(meta: dict[str, Any], state: TrainingState) -> None:
    """Types and ranges of everything JSON in the checkpoint (ValueError names the first wrong one)."""
    counts = {"step": state.step, "tokens_seen": state.tokens_seen, "epoch": state.epoch,
              "batch_in_epoch": state.batch_in_epoch}
    for name, value in counts.items():
        if not _whole(value):
            raise ValueError(f"state.{name} is {str(value)[:40]!r}, not a whole number")
    if not _whole(state.world_size, 1) or state.world_size > 4096:
        raise ValueError(f"state.world_size is {str(state.world_size)[:40]!r}")
    if not isinstance(state.settings, dict) or not isinstance(state.model_config, dict):
        raise ValueError("state.settings and state.model_config must be objects")
    if not isinstance(state.data_fingerprint, str):
        raise ValueError("state.data_fingerprint must be a string")
    optimizer = meta.get("optimizer")
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("param_groups"), list):
        raise ValueError("optimizer.param_groups must be a list")
    for group in optimizer["param_groups"]:
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise ValueError("each optimizer parameter group must be an object with params")
        if not all(_whole(p) for p in group["params"]):
            raise ValueError("optimizer parameter indices must be whole numbers")
        for key in ("lr", "eps", "weight_decay"):
            if key in group and not _number(group[key]):
                raise ValueError(f"optimizer {key} is {str(group[key])[:40]!r}")
        betas = group.get("betas", (0.9, 0.999))
        if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(_number(b) for b in betas):
            raise ValueError(f"optimizer betas are {str(betas)[:40]!r}")
    scalars = optimizer.get("scalars", {})
    if not isinstance(scalars, dict) or not all(isinstance(v, dict) and k.isdigit() for k, v in scalars.items()):
        raise ValueError("optimizer scalars must map parameter indices to objects")
    scheduler = meta.get("scheduler")
    if not isinstance(scheduler, dict):
        raise ValueError("scheduler must be an object")
    for key in ("base_lrs", "_last_lr"):
        if key in scheduler and not (isinstance(scheduler[key], list) and all(_number(v) for v in scheduler[key])):
            raise ValueError(f"scheduler {key} must be a list of numbers")
    for key in ("last_epoch", "_step_count"):
        if key in scheduler and not _whole(scheduler[key], -1):
            raise ValueError(f"scheduler {key} is {str(scheduler[key])[:40]!r}")
    lambdas = scheduler.get("lr_lambdas", [])
    if not isinstance(lambdas, list) or not all(v is None or isinstance(v, dict) for v in lambdas):
        raise ValueError("scheduler lr_lambdas must be a list")


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
            _, index, name = (key.split(".", 2) + ["", ""])[:3]
            if not index.isdigit() or not name:
                raise QkvError(f"checkpoint {p} holds an optimizer tensor named {key[:60]!r}")
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
    size = torch.get_rng_state().shape
    odd = [r for r, t in enumerate(rng_cpu) if t.dtype != torch.uint8 or t.shape != size]
    if odd:
        raise QkvError(f"checkpoint {p} holds a CPU RNG state for process {odd[0]} of the wrong type or size")
    odd_opt = [k for k, v in tensors.items() if k.startswith("optimizer.") and not v.is_floating_point() and k.split(".")[-1] != "step"]
    if odd_opt:
        raise QkvError(f"checkpoint {p}: optimizer tensor {odd_opt[0]} is not floating point")
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
        scheduler.load_state_dict(checkpoint.scheduler)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as error:
        first = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        raise QkvError(f"checkpoint {path} does not fit this model ({first})") from None
