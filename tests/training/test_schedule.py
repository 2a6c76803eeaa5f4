"""Warmup + cosine against torch's own LinearLR and CosineAnnealingLR chained."""

from __future__ import annotations

import pytest
import torch

from qkv.training.schedule import warmup_cosine


def lrs(make, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    scheduler = make(optimizer)
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("warmup", [2, 5])
def test_matches_torch_linear_then_cosine(warmup: int) -> None:
    total, min_ratio = 30, 0.1
    ours = lrs(lambda o: warmup_cosine(o, warmup_steps=warmup, total_steps=total, min_ratio=min_ratio), total)
    sched = torch.optim.lr_scheduler

    def reference(o):
        linear = sched.LinearLR(o, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
        cosine = sched.CosineAnnealingLR(o, T_max=total - warmup, eta_min=0.01 * min_ratio)
        return sched.SequentialLR(o, [linear, cosine], milestones=[warmup])

    torch.testing.assert_close(torch.tensor(ours), torch.tensor(lrs(reference, total)), rtol=1e-6, atol=1e-9)


def test_without_warmup_starts_at_peak_and_ends_at_floor() -> None:
    ours = lrs(lambda o: warmup_cosine(o, warmup_steps=0, total_steps=11, min_ratio=0.1), 12)
    assert ours[0] == pytest.approx(0.01)
    assert ours[10] > 0.001 and ours[11] == pytest.approx(0.001)  # the floor at step == total
    assert all(a >= b for a, b in zip(ours, ours[1:], strict=False))


def test_ratio_one_is_a_constant_rate_after_warmup() -> None:
    ours = lrs(lambda o: warmup_cosine(o, warmup_steps=3, total_steps=10, min_ratio=1.0), 10)
    assert ours[:3] == pytest.approx([0.01 / 3, 0.02 / 3, 0.01])
    assert ours[3:] == pytest.approx([0.01] * 7)
