"""Warmup + cosine against torch's own LinearLR and CosineAnnealingLR chained."""

from __future__ import annotations

import pytest
import torch

from qkv.training.schedule import WarmupCosine, warmup_cosine


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


def replanned(*, warmup: int, total: int, at: int, new_total: int, min_ratio: float = 0.1) -> list[float]:
    """Multipliers of a run re-planned at step `at` to end at `new_total`, after a save
    and a reload into a fresh schedule (what --resume does)."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    first = warmup_cosine(optimizer, warmup_steps=warmup, total_steps=total, min_ratio=min_ratio)
    for _ in range(at):
        optimizer.step()
        first.step()
    saved = first.state_dict()
    again = warmup_cosine(optimizer, warmup_steps=warmup, total_steps=total, min_ratio=min_ratio)
    again.load_state_dict(saved)
    schedule = again.lr_lambdas[0]
    schedule.replan(at, new_total)
    reloaded = warmup_cosine(optimizer, warmup_steps=warmup, total_steps=total, min_ratio=min_ratio)
    reloaded.load_state_dict(again.state_dict())  # the re-plan is part of the saved state
    return [reloaded.lr_lambdas[0](step) for step in range(new_total + 1)]


@pytest.mark.parametrize("at", [5, 12, 20])
def test_extending_continues_from_the_current_rate_down_to_the_floor(at: int) -> None:
    warmup, total, new_total = 3, 20, 40
    original = [WarmupCosine(warmup, total, 0.1)(step) for step in range(total + 1)]
    extended = replanned(warmup=warmup, total=total, at=at, new_total=new_total)
    assert extended[at] == pytest.approx(original[at])  # the rate the run reached: no jump
    tail = extended[at:]
    assert all(a >= b for a, b in zip(tail, tail[1:]))  # never rises again
    assert extended[new_total] == pytest.approx(0.1)
    if at == total:  # a finished run sits at the floor: its added steps stay there
        assert extended[at:] == pytest.approx([0.1] * (new_total - at + 1))
    else:
        assert extended[at + 1] < extended[at]


def test_extending_during_warmup_keeps_the_warmup_and_moves_the_end() -> None:
    extended = replanned(warmup=4, total=10, at=2, new_total=30)
    assert extended == pytest.approx([WarmupCosine(4, 30, 0.1)(step) for step in range(31)])


def test_shortening_an_unfinished_run_decays_sooner() -> None:
    shortened = replanned(warmup=0, total=40, at=10, new_total=20)
    assert shortened[10] == pytest.approx(WarmupCosine(0, 40, 0.1)(10))
    assert shortened[20] == pytest.approx(0.1)
