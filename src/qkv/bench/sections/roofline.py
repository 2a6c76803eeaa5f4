"""roofline: the fraction of the memory-bandwidth bound each qkv contender of the decode
section reaches on its decode steps.

Per run: bound = bytes the probe read per second just before and after the run (their mean
time; qkv.bench.measure.timing.alternate_probed) / bytes one decode step must read (the weights, and
the cached keys and values of the positions it can see: T + N/2 on average over the N - 1
decode steps after a T-token prompt, not the session's whole capacity, so the bound is that
of an implementation that reads nothing it masks out);
achieved = (N - 1) decode steps / (the run's time - its own time to the first token: the prompt). The fraction is
the median over runs of achieved / bound. A separate bandwidth measurement is shown
for reference.
"""

from __future__ import annotations

import statistics

from qkv.bench.common import Context, Section
from qkv.bench.sections.decode import measure_decode
from qkv.runtime import DecodeSession
from qkv.bench.measure.bandwidth import measure_read_bandwidth
from qkv.bench.measure.roofline import roofline_tokens_per_s, token_bytes


def roofline_section(ctx: Context) -> Section:
    run = measure_decode(ctx)
    section = Section("roofline")
    bandwidth = measure_read_bandwidth(ctx.sizes.bandwidth_bytes, max(ctx.options.repeats, 5))
    section.facts["read bandwidth GB/s, separate measurement (median)"] = round(bandwidth.gb_per_s, 2)
    new_tokens = run.section.facts["new tokens"]
    # decode step j (1..N-1) sees the prompt and j new positions: T + N/2 on average
    visible = run.section.facts["prompt tokens"] + new_tokens // 2
    section.facts["cached positions a decode step sees (mean)"] = visible
    by_name = {m.name: m for m in run.section.measurements}
    for name, prepared in run.models.items():
        with DecodeSession(prepared.model, capacity=run.capacity, setup=prepared.setup) as session:
            tb = token_bytes(prepared.model, session.caches, visible)
        achieved = [(new_tokens - 1) / (t - first) for t, first in zip(by_name[name].samples_s, run.first_token_s[name], strict=True)]
        gb_per_s = [run.probe_bytes / ((before + after) / 2) / 1e9 for before, after in run.around[name]]
        bounds = [roofline_tokens_per_s(tb.total, gb) for gb in gb_per_s]
        fractions = [a / b for a, b in zip(achieved, bounds, strict=True)]
        section.facts[name] = {
            "weight bytes per token": tb.weights,
            "kv bytes per token": tb.kv_cache,
            "read bandwidth GB/s just before and after each run (median)": round(statistics.median(gb_per_s), 2),
            "roofline tokens/s (median)": round(statistics.median(bounds), 2),
            "decode-step tokens/s (each call after its first token, median)": round(statistics.median(achieved), 2),
            "fraction of roofline (median over runs)": round(statistics.median(fractions), 4),
            "fraction of roofline per run": [round(f, 4) for f in fractions],
        }
    return section
