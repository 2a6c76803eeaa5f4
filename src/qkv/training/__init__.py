"""Training the book's GPT: data windows, tokenizer, loop, checkpoints, torch.distributed.

    train(settings, resume=False) -> TrainResult   one process, or many under torchrun
    TrainSettings.from_preset("tiny", data=..., out=..., **overrides)

The presets and settings are torch-free (so `qkv train --help` answers at once); the loop,
and torch with it, is imported on first use of `train`, `saved_settings` or `TrainResult`.
"""

from typing import Any

from qkv.training.presets import PRESETS, TrainPreset
from qkv.training.settings import TrainSettings

__all__ = ["PRESETS", "TrainPreset", "TrainResult", "TrainSettings", "saved_settings", "train"]

_FROM_LOOP = ("TrainResult", "saved_settings", "train")


def __getattr__(name: str) -> Any:
    if name in _FROM_LOOP:
        from qkv.training import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'qkv.training' has no attribute {name!r}")
