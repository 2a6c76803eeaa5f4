"""roofline: the fraction of the memory-bandwidth bound each qkv contender of the decode
section reaches on its decode steps.

Per round: bound = bytes the probe read per second in that round / bytes one decode step
reads (weights + the cache slots attention reads: the session's whole capacity, masked);
achieved = (N - 1) decode steps / (generate time - median prompt time). The fraction is
the median over rounds of achieved / bound. A separate bandwidth measurement is shown
for reference.
"""

from __future__ import annotations

import statistics

from qkv.bench.common import Context, Section
from qkv.bench.decode import measure_decode
from qkv.generation import DecodeSession
from qkv.perf.bandwidth import measure_read_bandwidth
from qkv.perf.roofline import roofline_tokens_per_s, token_bytes


def roofline_section(ctx: Context) -> Section:
    run = measure_decode(ctx)
    section = Section("roofline")
    bandwidth = measure_read_bandwidth(ctx.sizes.bandwidth_bytes, max(ctx.options.repeats, 5))
    section.facts["read bandwidth GB/s, separate measurement (median)"] = round(bandwidth.gb_per_s, 2)
    section.facts["cache slots read per decode step"] = run.capacity
    new_tokens = run.section.facts["new tokens"]
    by_name = {m.name: m for m in run.section.measurements}
    gb_per_s = [run.bandwidth.work / t / 1e9 for t in run.bandwidth.samples_s]  # per round
    for name, model in run.models.items():
        with DecodeSession(model, capacity=run.capacity):
            tb = token_bytes(model, run.capacity)
        achieved = [(new_tokens - 1) / (t - run.prefill_s[name]) for t in by_name[name].samples_s]
        bounds = [roofline_tokens_per_s(tb.total, gb) for gb in gb_per_s]
        fractions = [a / b for a, b in zip(achieved, bounds, strict=True)]
        section.facts[name] = {
            "weight bytes per token": tb.weights,
            "kv bytes per token": tb.kv_cache,
            "read bandwidth GB/s in the same rounds (median)": round(statistics.median(gb_per_s), 2),
            "roofline tokens/s (median)": round(statistics.median(bounds), 2),
            "decode-step tokens/s (prefill subtracted, median)": round(statistics.median(achieved), 2),
            "fraction of roofline (median over rounds)": round(statistics.median(fractions), 4),
            "fraction of roofline per round": [round(f, 4) for f in fractions],
        }
    return section
