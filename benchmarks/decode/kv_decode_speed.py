"""SmolLM2 decode speed at a long context, the full KV cache against the int4 cache, in one run.

    .venv/bin/python benchmarks/decode/kv_decode_speed.py [CONTEXT=4000] [STEPS=8] [ROUNDS=5] [THREADS=1]

The models are prepared as `qkv bench --only kv-cache`'s decode-speed part prepares them
(qkv.bench.sections.kv_cache._speed: `qkv generate`'s default precision, compiled, one DecodeSession
per cache kind, each prefilled with the first CONTEXT tokens of the long text); rounds of
STEPS greedy steps alternate between them, who goes first rotating, after one warm-up round
(benchmarks/harness.py's `alternate_own`: qkv.bench.measure.timing's rounds, each side
reporting its wall and CPU seconds). Prints the median
tokens/s by the wall clock and per CPU-second of this process (the steadier measure on a
shared machine: decode runs on THREADS threads, and on a busy 2-core machine two threads
mostly wait on each other), their ratios, then where 4 steps of each spend their time
(torch.profiler, self CPU time). Not a test: numbers go to benchmarks/RESULTS.md. The
positional arguments are all optional: `--help` prints this.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
from qkv.generation.cache_kinds import cache_kind  # noqa: E402
from qkv.names import DEFAULT_PRECISION  # noqa: E402
from qkv.runtime import DecodeSession  # noqa: E402
from qkv.runtime.native import native_kernels  # noqa: E402
from qkv.runtime.prepare import load_for_generation  # noqa: E402
from qkv.util.long_text import long_text  # noqa: E402


def main(argv: list[str]) -> None:
    if any(a in ("-h", "--help") for a in argv):
        raise SystemExit(__doc__)
    context, steps, rounds, threads = ([int(a) for a in argv] + [4000, 8, 5, 1][len(argv):])[:4]
    torch.set_num_threads(threads)
    harness.header(f"decode at a {context}-token context: the full KV cache against the int4 cache")
    print(native_kernels().describe(), flush=True)
    sessions: dict[str, list] = {}
    for name in ("full", "int4"):
        model, tokenizer, setup = load_for_generation("smollm2", precision=DEFAULT_PRECISION, compile=True)
        ids = torch.tensor(tokenizer.encode(long_text()).ids[:context])[None]  # (1, N)
        session = DecodeSession(model, capacity=context + steps * (rounds + 2) + 8, kind=cache_kind(name),
                                setup=setup).__enter__()
        start = time.perf_counter()
        token = session.decode(session.prefill(ids).argmax(-1)).argmax(-1)  # the first step compiles
        print(f"{name}: prefill + first step {time.perf_counter() - start:.1f} s", flush=True)
        sessions[name] = [session, token]
    def steps_of(state: list) -> dict[str, float]:
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            state[1] = state[0].decode(state[1]).argmax(-1)
        return {"wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0}

    own = harness.alternate_own({name: (lambda state=state: steps_of(state)) for name, state in sessions.items()},
                                rounds=rounds, warmup=1)  # the warm-up round: one untimed call of each
    wall = {name: harness.Measurement(name, steps, "tokens", s["wall_s"]) for name, s in own.items()}
    cpu = {name: harness.Measurement(f"{name} per CPU-second", steps, "tokens", s["cpu_s"]) for name, s in own.items()}
    for name in sessions:
        w, c = wall[name], cpu[name]
        print(f"{name}: tokens/s {w.rate:.2f} (rounds {[round(steps / x, 2) for x in w.samples_s]}), "
              f"per CPU-second {c.rate:.2f} (rounds {[round(steps / x, 2) for x in c.samples_s]})")
    print(f"int4 / full: {harness.ratio(wall['int4'], wall['full']).value:.3f} by the wall clock, "
          f"{harness.ratio(cpu['int4'], cpu['full']).value:.3f} per CPU-second", flush=True)
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
