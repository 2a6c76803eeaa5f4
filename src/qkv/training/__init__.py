"""Training the book's GPT: data windows, tokenizer, loop, checkpoints, torch.distributed.

    train(settings, resume=False) -> TrainResult   one process, or many under torchrun
    TrainSettings.from_preset("tiny", data=..., out=..., **overrides)
"""

from qkv.training.loop import TrainResult, saved_settings, train
from qkv.training.presets import PRESETS, TrainPreset
from qkv.training.settings import TrainSettings

__all__ = ["PRESETS", "TrainPreset", "TrainResult", "TrainSettings", "saved_settings", "train"]
