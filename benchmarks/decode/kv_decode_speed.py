"""SmolLM2 decode speed at a long context, the full KV cache against the int4 cache, in one run.

    .venv/bin/python benchmarks/kv_decode_speed.py [CONTEXT=4000] [STEPS=8] [ROUNDS=5] [THREADS=1]

The models are prepared as `qkv bench --only kv-cache`'s decode-speed part prepares them
(qkv.bench.sections.kv_cache._speed: `qkv generate`'s default precision, compiled, one DecodeSession
per cache kind, each prefilled with the first CONTEXT tokens of the long text); rounds of
STEPS greedy steps alternate between them after one warm-up round. Prints the median
tokens/s by the wall clock and per CPU-second of this process (the steadier measure on a
shared machine: decode runs on THREADS threads, and on a busy 2-core machine two threads
mostly wait on each other), their ratios, then where 4 steps of each spend their time
(torch.profiler, self CPU time). Not a test: numbers go to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from qkv.runtime import DecodeSession
from qkv.generation.cache_kinds import cache_kind
from qkv.util.long_text import long_text
from qkv.runtime.native import native_kernels
from qkv.runtime.prepare import load_for_generation
from qkv.names import DEFAULT_PRECISION


def main(argv: list[str]) -> None:
    context, steps, rounds, threads = ([int(a) for a in argv] + [4000, 8, 5, 1][len(argv):])[:4]
    torch.set_num_threads(threads)
    print(native_kernels().describe(), flush=True)
    sessions: dict[str, list] = {}
    for name in ("full", "int4"):
        model, tokenizer, _ = load_for_generation("smollm2", precision=DEFAULT_PRECISION, compile=True)
        ids = torch.tensor(tokenizer.encode(long_text()).ids[:context])[None]  # (1, N)
        session = DecodeSession(model, capacity=context + steps * (rounds + 2) + 8, kind=cache_kind(name)).__enter__()
        start = time.perf_counter()
        token = session.decode(session.prefill(ids).argmax(-1)).argmax(-1)  # the first step compiles
        print(f"{name}: prefill + first step {time.perf_counter() - start:.1f} s", flush=True)
        sessions[name] = [session, token]
    wall: dict[str, list[float]] = {name: [] for name in sessions}
    cpu: dict[str, list[float]] = {name: [] for name in sessions}
    for round_ in range(rounds + 1):
        for name, state in sessions.items():
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                state[1] = state[0].decode(state[1]).argmax(-1)
            if round_:  # round 0 warms up
                wall[name].append(steps / (time.perf_counter() - w0))
                cpu[name].append(steps / (time.process_time() - c0))
    for name in sessions:
        print(f"{name}: tokens/s {statistics.median(wall[name]):.2f} (rounds {[round(x, 2) for x in wall[name]]}), "
              f"per CPU-second {statistics.median(cpu[name]):.2f} (rounds {[round(x, 2) for x in cpu[name]]})")
    print(f"int4 / full: {statistics.median(wall['int4']) / statistics.median(wall['full']):.3f} by the wall clock, "
          f"{statistics.median(cpu['int4']) / statistics.median(cpu['full']):.3f} per CPU-second", flush=True)
    for name, state in sessions.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(4):
                state[1] = state[0].decode(state[1]).argmax(-1)
        print(f"{name}: 4 steps profiled, self CPU time per step:")
        for event in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:6]:
            print(f"  {event.key[:60]:60s} {event.self_cpu_time_total / 4 / 1000:8.2f} ms  x{event.count // 4}")
    for session, _ in sessions.values():
        session.close()


if __name__ == "__main__":
    main(sys.argv[1:])
