"""qkv's default decode against llama.cpp's own `llama-bench` on the same GGUF file.

llama-bench's `-p 0 -n 128` is pure decode: 128 tokens after an empty prompt, the median of
its repetitions. qkv's side is the path `qkv generate` takes without flags
(`load_for_generation`: the file's default precision, compiled, qkv's kernels), timed over
the same 128 decode steps after a one-token prompt (its prefill excluded). The two alternate
`--rounds` times in one run; medians and their ratio are printed.

    .venv/bin/python benchmarks/decode_vs_llama_bench.py --llama-bench /work/peers/build/bin/llama-bench \\
        [--model smollm2 | FILE.gguf] [--threads 2] [--rounds 3] [--dtype auto | int8 | ...]

Build llama-bench as the README's benchmark section says (llama.cpp's own tools, this CPU's
best flags).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch

from qkv.attention.caches.kv_cache import SlotKVCache
from qkv.generation import continue_from, warm_up
from qkv.models.loader import named_model, smollm2_path
from qkv.names import CHOICES, DEFAULT_PRECISION
from qkv.runtime import DecodeSession, load_for_generation

TOKENS = 128


def qkv_rate(model: torch.nn.Module, tokens: int) -> float:
    """Decode tokens/s over `tokens` steps after a one-token prompt (prefill not counted), in a
    session of slots as `qkv generate` decodes."""
    prompt = torch.zeros(1, dtype=torch.long)
    with DecodeSession(model, capacity=tokens + 8, kind=SlotKVCache) as session:  # generate's session kind
        logits = session.prefill_row(0, prompt)[None]  # (1, V)
        start = time.perf_counter()
        for _ in continue_from(session, logits, tokens + 1):  # tokens + 1 choices: `tokens` decode steps
            pass
        return tokens / (time.perf_counter() - start)


def llama_rate(binary: str, path: str, threads: int, tokens: int) -> float:
    out = subprocess.run([binary, "-m", path, "-p", "0", "-n", str(tokens), "-t", str(threads), "-o", "json"],
                         capture_output=True, text=True, timeout=900, check=True)
    runs = json.loads(out.stdout)
    return float(statistics.median(r["avg_ts"] for r in runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bench", required=True, help="path of llama.cpp's llama-bench")
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a .gguf file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=CHOICES, default=DEFAULT_PRECISION,
                        help="qkv's decode precision, as `qkv generate --dtype` (default: the file's)")
    args = parser.parse_args()
    path = str(smollm2_path()) if named_model(args.model) else args.model
    torch.set_num_threads(args.threads)
    model, _, setup = load_for_generation(path, precision=args.dtype)
    warm_up(model, capacity=TOKENS + 8)
    print(f"qkv: {setup.describe()}; {os.cpu_count()} cores, {args.threads} threads; {path}", flush=True)
    ours, theirs = [], []
    for round_ in range(args.rounds):
        ours.append(qkv_rate(model, TOKENS))
        theirs.append(llama_rate(args.llama_bench, path, args.threads, TOKENS))
        print(f"round {round_}: qkv {ours[-1]:.1f} tokens/s, llama-bench {theirs[-1]:.1f}", flush=True)
    q, l = statistics.median(ours), statistics.median(theirs)
    print(f"median qkv {q:.1f} tokens/s, llama-bench {l:.1f} tokens/s, ratio {q / l:.2f}x")


if __name__ == "__main__":
    main()
