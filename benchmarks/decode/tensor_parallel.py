"""Tensor parallelism on one machine: decode time per token and peak memory per rank of N local
ranks (gloo on loopback) against one process, with the all-reduces' share of each token.

For every N in --ranks the script starts N processes of itself (RANK, WORLD_SIZE, MASTER_* set
as torchrun sets them; N = 1 is one process with no group) and each:
  - loads its slice of --model at --dtype (qkv.models.tensor_parallel + qkv.runtime.tensor_parallel);
  - decodes --tokens greedy tokens after a prefill of the prompt, --rounds times, and takes the
    median of (time of prefill + tokens - time of the prefill alone) / tokens;
  - times every collective it makes (the all-reduces after the embedding, attention and MLP,
    and the gather of the logits) over the same decode steps;
  - reports its peak RSS (getrusage) and the bytes of its weights.
N = 1 runs the same rank code with no collectives. A rank decodes on qkv's native layer split
at the all-reduces (--step native, where its layers allow) or its modules (--step modules).
"one process" is what `qkv generate` runs (the whole-layer native step where it applies).
Threads: --threads split evenly over the ranks (at least one each).

    .venv/bin/python benchmarks/decode/tensor_parallel.py --model smollm2 --ranks 1 3
    .venv/bin/python benchmarks/decode/tensor_parallel.py --model FILE.gguf --dtype int8 --ranks 1 2 4
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

PROMPT = "The keys of every token are kept in the cache, and each new query is compared with them"


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _decode_seconds(model, ids, tokens: int, rounds: int, spent: list[float], setup=None) -> tuple[float, float]:
    """Median seconds per decoded token, and the collectives' seconds in it (`setup`: how the
    model was prepared, so its decode steps run the layer step it has; None: the modules)."""
    from qkv.generation.loop import generate

    per_token, per_collective = [], []
    for _ in range(rounds + 1):  # the first round warms up
        spent[0] = 0.0
        start = time.perf_counter()
        generate(model, ids, 1, setup=setup)
        prefill, prefill_collective = time.perf_counter() - start, spent[0]
        spent[0] = 0.0
        start = time.perf_counter()
        generate(model, ids, tokens + 1, setup=setup)
        whole, whole_collective = time.perf_counter() - start, spent[0]
        per_token.append((whole - prefill) / tokens)
        per_collective.append((whole_collective - prefill_collective) / tokens)
    return harness.median(per_token[1:]), harness.median(per_collective[1:])


def rank_main(args) -> None:
    import torch

    from qkv.models.loader import open_model
    from qkv.models.tensor_parallel.group import TensorParallel, join_tensor_parallel
    from qkv.models.tensor_parallel.opened import open_rank
    from qkv.runtime.prepare import load_dtype
    from qkv.runtime.tensor_parallel import prepare_rank

    torch.set_num_threads(args.rank_threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    spent = [0.0]

    @dataclasses.dataclass(frozen=True)
    class Timed(TensorParallel):
        """The group, each collective's seconds added to `spent`."""

        def all_reduce(self, x, what="all-reduce"):
            start = time.perf_counter()
            try:
                return super().all_reduce(x, what)
            finally:
                spent[0] += time.perf_counter() - start

        def all_gather(self, x, what="all-gather"):
            start = time.perf_counter()
            try:
                return super().all_gather(x, what)
            finally:
                spent[0] += time.perf_counter() - start

    joined = join_tensor_parallel(world)
    tp = Timed(joined.rank, joined.world, joined.group, joined.timeout)
    opened = open_model(args.model, load_dtype(args.dtype), keep_blocks=True, max_memory=2**40)
    start = time.perf_counter()
    loaded, setup = prepare_rank(open_rank(opened, tp), args.dtype)
    load_s = time.perf_counter() - start
    weights = sum(t.nbytes for t in [*loaded.model.parameters(), *loaded.model.buffers()])
    ids = torch.tensor([loaded.tokenizer.encode(PROMPT).ids])
    native = setup if args.step == "native" else None
    step, collective = _decode_seconds(loaded.model, ids, args.tokens, args.rounds, spent, native)
    print(json.dumps({"rank": tp.rank, "world": world, "precision": setup.precision, "load_s": load_s,
                      "native": native is not None and setup.layer_step is not None,
                      "decode_ms": 1e3 * step, "collective_ms": 1e3 * collective,
                      "peak_rss_mib": _rss_mib(), "weights_mib": weights / 2**20}), flush=True)
    os._exit(0)


def one_process(args) -> dict:
    """What `qkv generate` runs, timed the same way, in a child process of its own."""
    code = ("import json, sys, time, torch; sys.path.insert(0, 'benchmarks/decode'); import tensor_parallel as t\n"
            "from qkv.runtime.prepare import load_for_generation\n"
            f"torch.set_num_threads({args.threads})\n"
            f"model, tok, setup = load_for_generation({args.model!r}, precision={args.dtype!r})\n"
            "ids = torch.tensor([tok.encode(t.PROMPT).ids])\n"
            f"step, _ = t._decode_seconds(model, ids, {args.tokens}, {args.rounds}, [0.0], setup)\n"
            "w = sum(x.nbytes for x in [*model.parameters(), *model.buffers()])\n"
            "print(json.dumps({'precision': setup.precision, 'how': setup.describe(), 'decode_ms': 1e3 * step,"
            " 'peak_rss_mib': t._rss_mib(), 'weights_mib': w / 2**20}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=args.timeout,
                          env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "src")})
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_ranks(args, n: int) -> list[dict]:
    port = harness.free_port()
    rank_threads = max(1, args.threads // n)
    procs = []
    try:
        for rank in range(n):
            env = {**os.environ, "OMP_NUM_THREADS": str(rank_threads)}
            if n > 1:
                env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port))
            else:
                env.pop("WORLD_SIZE", None)
            procs.append(subprocess.Popen([sys.executable, __file__, "--rank-of", *sys.argv[1:],
                                           "--rank-threads", str(rank_threads)],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        rows = []
        for proc in procs:
            out, err = proc.communicate(timeout=args.timeout)
            if proc.returncode != 0:
                raise SystemExit(err[-2000:])
            rows.append(json.loads(out.strip().splitlines()[-1]))
        return rows
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def main() -> None:
    made = harness.parser(__doc__, rounds=3)
    made.add_argument("--model", default="smollm2")
    made.add_argument("--dtype", default="auto")
    made.add_argument("--ranks", type=int, nargs="+", default=[1, 3])
    made.add_argument("--tokens", type=int, default=16)
    made.add_argument("--step", choices=("native", "modules"), default="native",
                      help="a rank's decode step: qkv's layer in two calls split at the all-reduces, or the modules")
    made.add_argument("--timeout", type=float, default=900)
    made.add_argument("--rank-of", action="store_true", help=argparse_hidden())
    made.add_argument("--rank-threads", type=int, default=1, help=argparse_hidden())
    harness.add_threads(made, os.cpu_count() or 1)
    harness.add_json(made)
    args = made.parse_args()
    if args.rank_of:
        return rank_main(args)
    facts = harness.header(f"tensor parallel on loopback: {args.model} at {args.dtype}, ranks' step: {args.step}")
    one = one_process(args)
    print(f"one process ({one['how']}, {args.threads} threads): {one['decode_ms']:.1f} ms/token, "
          f"peak RSS {one['peak_rss_mib']:.0f} MiB, weights {one['weights_mib']:.0f} MiB")
    print("| ranks | ms/token (rank 0) | collectives ms/token (share) | vs one process | peak RSS per rank MiB "
          "(max) | / one process | weights per rank MiB |")
    print("|---|---|---|---|---|---|---|")
    results = {"one_process": one, "ranks": {}}
    for n in args.ranks:
        rows = run_ranks(args, n)
        results["ranks"][n] = rows
        head = rows[0]
        rss = max(r["peak_rss_mib"] for r in rows)
        print(f"| {n} | {head['decode_ms']:.1f} | {head['collective_ms']:.1f} "
              f"({head['collective_ms'] / head['decode_ms']:.0%}) | {one['decode_ms'] / head['decode_ms']:.2f}x | "
              f"{rss:.0f} | {rss / one['peak_rss_mib']:.2f} | {max(r['weights_mib'] for r in rows):.0f} |", flush=True)
    if args.json:
        harness.write_json(args.json, results, facts)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
