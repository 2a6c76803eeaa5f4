"""Memory read bandwidth, measured: the numerator of the decode roofline.

A reduction over a tensor much larger than the last-level cache reads every byte once
from main memory and does almost no arithmetic per byte, so its speed is the machine's
read bandwidth as PyTorch (with the current thread count) can use it. The median over
several runs is robust to a noisy neighbour. The tensor lies on 2 MB pages where Linux
gives them, as prepared weights do (qkv.runtime.huge_pages): on 4 KB pages the probe reads
slower than a decode step, and the roofline would not be one.

Shape legend: N elements of the float32 probe tensor.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from qkv.runtime.huge_pages import huge_ones


@dataclass(frozen=True)
class Bandwidth:
    gb_per_s: float  # median, 1 GB = 1e9 bytes
    samples_gb_per_s: tuple[float, ...]
    nbytes: int
    threads: int


def measure_read_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 7) -> Bandwidth:
    """Median GB/s of `torch.sum` over an `nbytes` float32 tensor (default 512 MiB).

    The tensor must be far larger than the caches (tens of MiB here) or the result is
    cache bandwidth, not memory bandwidth.
    """
    if nbytes < 4 * 2**20 or repeats < 1:
        raise ValueError(f"need nbytes >= 4 MiB and repeats >= 1, got {nbytes}, {repeats}")
    probe = huge_ones(nbytes // 4)  # (N,) float32
    probe.sum()  # touch every page once before timing
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        probe.sum()
        samples.append(probe.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return Bandwidth(
        gb_per_s=statistics.median(samples),
        samples_gb_per_s=tuple(samples),
        nbytes=probe.numel() * 4,
        threads=torch.get_num_threads(),
    )
