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


def _run(contenders: dict[str, Callable[[], object]], repeats: int, warmup: int,
         probe: Callable[[], object] | None) -> tuple[dict[str, list[float]], list[float], list[str]]:
    """Every contender `warmup` times untimed, then `repeats` rounds of one call each, who
    goes first rotating; `probe`, if given, also runs before the first timed call and after
    each one. Returns the samples per contender, the probe's samples and the order of calls."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
        if probe is not None:
            probe()
    order = [name for round_ in range(repeats) for name in names[round_ % len(names):] + names[:round_ % len(names)]]
    samples: dict[str, list[float]] = {name: [] for name in names}
    probes = [] if probe is None else [_timed(probe)]
    for name in order:
        samples[name].append(_timed(contenders[name]))
        if probe is not None:
            probes.append(_timed(probe))
    return samples, probes, order


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _measurements(samples: dict[str, list[float]], work: float | dict[str, float], unit: str
                  ) -> dict[str, Measurement]:
    per = work if isinstance(work, dict) else {name: work for name in samples}
    return {name: Measurement(name, float(per[name]), unit, tuple(times)) for name, times in samples.items()}


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
    samples, _, _ = _run(contenders, repeats, warmup, None)
    return _measurements(samples, work, unit)


@dataclass(frozen=True)
class Probed:
    """What `alternate_probed` measured."""

    measurements: dict[str, Measurement]
    probe: Measurement  # every probe call, in the order they ran
    around: dict[str, tuple[tuple[float, float], ...]]  # per contender sample: probe seconds just before, after


def alternate_probed(
    contenders: dict[str, Callable[[], object]],
    probe: Callable[[], object],
    *,
    work: float | dict[str, float],
    unit: str,
    probe_work: float,
    probe_unit: str,
    repeats: int,
    warmup: int = 1,
) -> Probed:
    """`alternate`, with `probe` also called before the first contender and after every one,
    so that each contender's sample has a probe run on either side of it.

    A contender is then judged by the machine as it was at that moment: on a shared VM the
    memory bandwidth switches between regimes within seconds (about 50 and 84 GB/s on the
    machine of benchmarks/HISTORY.md), and a probe that ran a contender or two away in the
    round may have seen the other regime.
    """
    samples, probes, order = _run(contenders, repeats, warmup, probe)
    around: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    for i, name in enumerate(order):  # call i ran between probe samples i and i + 1
        around[name].append((probes[i], probes[i + 1]))
    return Probed(_measurements(samples, work, unit), Measurement("probe", probe_work, probe_unit, tuple(probes)),
                  {name: tuple(pairs) for name, pairs in around.items()})
