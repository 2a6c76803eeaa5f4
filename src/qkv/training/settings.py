"""The resolved settings of one training run, saved in its checkpoint.

A run's settings are a preset's defaults with the user's overrides applied. They are a
frozen dataclass so the loop never changes them, and they round-trip through JSON so a
checkpoint carries them and `--resume` continues with exactly the same run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

from qkv.errors import QkvError
from qkv.models.configs.gpt2 import GPTConfig
from qkv.training.presets import PRESETS

DType = Literal["float32", "bfloat16"]
DTYPES: tuple[str, ...] = ("float32", "bfloat16")
SAMPLE_PROMPT = "Every effort moves you"  # the book's chapter-5 start context


@dataclass(frozen=True)
class TrainSettings:
    data: str
    out: str
    preset: str = "tiny"
    context_length: int = 64
    stride: int = 64
    batch_size: int = 8  # per process; the global batch is batch_size x world size
    epochs: int | None = 1
    max_steps: int | None = None
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decay ends at lr x min_lr_ratio
    weight_decay: float = 0.1
    warmup_steps: int = 0
    grad_clip: float | None = 1.0  # None: no gradient clipping (the book's run)
    eval_every: int = 20
    eval_windows: int = 64
    save_every: int = 50
    seed: int = 123
    dtype: DType = "float32"
    dropout: float = 0.1
    tokenizer: str | None = None
    vocab_size: int = 512  # BPE target size, and the model's smallest vocabulary
    sample_prompt: str = SAMPLE_PROMPT
    sample_tokens: int = 20
    # Shard every window over the processes (ring attention) instead of splitting the batch:
    # the global batch is batch_size, and the run equals one process with that batch.
    context_parallel: bool = False
    # The model's shape beyond the preset's (None: the preset's).
    emb_dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None

    def __post_init__(self) -> None:
        _check_types(self)
        positive = {
            "context_length": self.context_length, "stride": self.stride,
            "batch_size": self.batch_size, "eval_every": self.eval_every,
            "eval_windows": self.eval_windows, "save_every": self.save_every,
            "vocab_size": self.vocab_size,
        }
        for name in ("emb_dim", "n_layers", "n_heads"):
            if getattr(self, name) is not None:
                positive[name] = getattr(self, name)
        if self.epochs is not None:
            positive["epochs"] = self.epochs
        if self.max_steps is not None:
            positive["max_steps"] = self.max_steps
        bad = {k: v for k, v in positive.items() if v < 1}
        if bad:
            raise QkvError(f"these options must be at least 1: {bad}")
        if (self.epochs is None) == (self.max_steps is None):
            raise QkvError("give exactly one of --epochs and --max-steps")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise QkvError(f"the gradient clipping norm must be > 0, got {self.grad_clip}")
        if self.lr <= 0 or self.weight_decay < 0 or self.warmup_steps < 0:
            raise QkvError(
                f"need --lr > 0, --weight-decay >= 0, --warmup-steps >= 0; got lr={self.lr}, "
                f"weight_decay={self.weight_decay}, warmup_steps={self.warmup_steps}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise QkvError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 <= self.dropout < 1.0:
            raise QkvError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.context_parallel and self.dropout > 0:
            raise QkvError(
                f"--context-parallel needs --dropout 0 (ring attention has no attention dropout), "
                f"got {self.dropout}"
            )
        if self.dtype not in DTYPES:
            raise QkvError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.preset not in PRESETS:
            raise QkvError(f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")

    @classmethod
    def from_preset(cls, preset: str, *, data: str, out: str, **overrides: Any) -> TrainSettings:
        """The preset's defaults, then every override that is not None."""
        if preset not in PRESETS:
            raise QkvError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        p = PRESETS[preset]
        base: dict[str, Any] = dict(
            data=data, out=out, preset=preset, context_length=p.model.context_length,
            batch_size=p.batch_size, epochs=p.epochs, lr=p.lr, weight_decay=p.weight_decay,
            warmup_steps=p.warmup_steps, eval_every=p.eval_every, save_every=p.save_every,
            eval_windows=p.eval_windows, dropout=p.model.drop_rate,
            vocab_size=p.tokenizer_vocab_size, grad_clip=p.grad_clip, min_lr_ratio=p.min_lr_ratio,
            sample_tokens=p.sample_tokens,
        )
        given = {k: v for k, v in overrides.items() if v is not None}
        if given.get("max_steps") is not None:
            base["epochs"] = None
        base.update(given)
        base.setdefault("stride", base["context_length"])  # the book: stride = window length
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainSettings:
        if not isinstance(values, dict):
            raise QkvError(f"checkpoint settings must be an object, not {type(values).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = set(values) - names
        if unknown:
            raise QkvError(f"checkpoint settings have unknown fields {sorted(unknown)}")
        return cls(**values)

    def with_changes(self, **changes: Any) -> TrainSettings:
        return replace(self, **changes)


def _check_types(settings: TrainSettings) -> None:
    """Each field of the type it is declared with (settings also come from checkpoints)."""
    for field in fields(settings):
        value = getattr(settings, field.name)
        kinds = [_kind(part.strip()) for part in str(field.type).split("|")]
        if any(kind is _UNKNOWN for kind in kinds):
            continue
        ok = any(
            value is None if kind is None
            else isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) if kind is float
            else isinstance(value, int) and not isinstance(value, bool) if kind is int
            else isinstance(value, kind)
            for kind in kinds
        )
        if not ok:
            raise QkvError(f"setting {field.name} has the wrong type or value: {str(value)[:40]!r}")


_UNKNOWN = object()
_KINDS: dict[str, Any] = {"int": int, "float": float, "str": str, "bool": bool, "DType": str, "None": None}


def _kind(name: str) -> Any:
    return _KINDS.get(name, _UNKNOWN)


def model_config(settings: TrainSettings, tokenizer_vocab: int) -> GPTConfig:
    """The preset's model with the run's window length, dropout and any width, depth or
    heads given, and a vocabulary that is the preset's or, if larger, the tokenizer's."""
    preset = PRESETS[settings.preset].model
    shape = {k: getattr(settings, k) for k in ("emb_dim", "n_layers", "n_heads") if getattr(settings, k) is not None}
    try:
        return replace(
            preset, vocab_size=max(settings.vocab_size, tokenizer_vocab),
            context_length=settings.context_length, drop_rate=settings.dropout, **shape,
        )
    except ValueError as error:
        raise QkvError(f"--emb-dim, --n-layers, --n-heads: {error}") from None
