"""Learning-rate schedule: linear warmup, then cosine decay to a floor.

It is a small callable object for torch's LambdaLR, so the scheduler's state_dict
(which keeps the object's attributes) stays plain JSON.

Changing a run's length when resuming it (`--resume --epochs N` or `--max-steps N`) never
makes the rate jump: `replan` keeps the rate the run has reached and decays it along a new
cosine to the same floor over the steps that remain. A finished run sits at the floor, so
its added steps train at the floor rate (a constant tail). During warmup only the end of
the decay moves (the warmup does not depend on the length). The re-planned segment is part
of the saved state, so a resumed extension continues it exactly.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def _cosine(start: float, end: float, progress: float) -> float:
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class WarmupCosine:
    """Multiplier of the peak lr at a 0-based step."""

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_ratio = min_ratio
        # Set by `replan`: from this step on, a cosine from replan_ratio to min_ratio.
        self.replan_step: int | None = None
        self.replan_ratio = 1.0

    def __call__(self, step: int) -> float:
        if self.replan_step is not None and step >= self.replan_step:
            span = max(1, self.total_steps - self.replan_step)
            return _cosine(self.replan_ratio, self.min_ratio, (step - self.replan_step) / span)
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        return _cosine(1.0, self.min_ratio, (step - self.warmup_steps) / decay_steps)

    def replan(self, step: int, total_steps: int) -> None:
        """The run, at `step`, now ends at `total_steps`: continue from the current rate."""
        if total_steps == self.total_steps:
            return
        if step >= self.warmup_steps:
            self.replan_ratio = self(step)
            self.replan_step = step
        self.total_steps = total_steps


def warmup_cosine(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, min_ratio: float
) -> LambdaLR:
    return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_ratio))
