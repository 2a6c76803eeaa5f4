"""Learning-rate schedule: linear warmup, then cosine decay to a floor.

It is a small callable object for torch's LambdaLR, so the scheduler's state_dict
(which keeps the object's attributes) stays plain JSON.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


class WarmupCosine:
    """Multiplier of the peak lr at a 0-based step."""

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * cosine


def warmup_cosine(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, min_ratio: float
) -> LambdaLR:
    return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_ratio))
