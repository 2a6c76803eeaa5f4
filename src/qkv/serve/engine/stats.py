"""What the engine counts for /metrics: counters and gauges, and histograms of the times a
request spends waiting, being prefilled, for its first token and between its tokens.

The engine thread writes; the metrics page reads (qkv.serve.http.metrics). A histogram holds
bucket counts and a sum, not the samples, so its memory stays the same however long the
server runs and whether or not anyone reads /metrics.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # seconds
GAP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)  # seconds between two tokens


class Histogram:
    """Cumulative-bucket histogram of seconds, as Prometheus exposes one."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self._counts = [0] * (len(buckets) + 1)  # the last: above every bucket (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        bucket = next((i for i, edge in enumerate(self.buckets) if seconds <= edge), len(self.buckets))
        with self._lock:
            self._counts[bucket] += 1
            self._sum += seconds

    def snapshot(self) -> tuple[list[int], float]:
        """(cumulative counts per bucket, +Inf last; sum), read together."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for n in counts:
            running += n
            cumulative.append(running)
        return cumulative, total


@dataclass
class EngineStats:
    """Counters the metrics page reads (written by the engine thread only)."""

    slots: int = 0
    occupied: int = 0
    waiting: int = 0
    steps: int = 0
    prefill_chunks: int = 0  # prompt pieces prefilled between decode steps
    prompt_tokens: int = 0
    prompt_tokens_reused: int = 0  # of prompt_tokens: taken from a slot's cache, not prefilled
    completion_tokens: int = 0
    tokens_per_second: float = 0.0
    ttft: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))  # submission -> first token
    queue: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))  # submission -> a slot
    prefill: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))  # a slot -> prompt prefilled
    inter_token: Histogram = field(default_factory=lambda: Histogram(GAP_BUCKETS))  # one token -> the next
