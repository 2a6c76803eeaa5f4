"""Side-by-side timing: contenders alternate round by round, medians, ratios from them.

A noisy neighbour on a shared machine slows whichever contender happens to run at that
moment; alternating the contenders within each round (and rotating who goes first)
spreads that noise over all of them, and the median discards the worst rounds. Ratios
are always computed from the medians of the same run, never across runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Measurement:
    name: str
    work: float  # units of work per call (tokens, calls ...)
    unit: str  # what `work` counts, e.g. "tokens"
    samples_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def rate(self) -> float:
        """Work per second at the median time, e.g. tokens/s."""
        return self.work / self.median_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "samples_s": list(self.samples_s), "median_s": self.median_s,
                "rate": self.rate}


@dataclass(frozen=True)
class Ratio:
    of: str
    over: str
    value: float  # rate(of) / rate(over)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ratio(of: Measurement, over: Measurement) -> Ratio:
    return Ratio(of.name, over.name, of.rate / over.rate)


def alternate(
    contenders: dict[str, Callable[[], object]],
    *,
    work: float | dict[str, float],
    unit: str,
    repeats: int,
    warmup: int = 1,
) -> dict[str, Measurement]:
    """Time each contender `repeats` times, one call of each per round (order rotating).

    `work` is the work one call does (the same for all, or per contender). Every
    contender is called `warmup` times first, untimed.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            contenders[name]()
            samples[name].append(time.perf_counter() - start)
    per = work if isinstance(work, dict) else {name: work for name in names}
    return {name: Measurement(name, float(per[name]), unit, tuple(samples[name])) for name in names}
