"""`qkv generate` as a user runs it (no flags) against `llama-bench -p 0 -n N -t 2`, whole processes alternated.

Issue 33's headline measure: each round runs `qkv generate --model FILE --prompt P
--max-new-tokens N` with no other flag (its default precision, kernels and thread count) and
`llama-bench -m FILE -p 0 -n N -t T -r 1`, the two processes one after the other, who goes
first rotating. qkv's rate is the one it prints (tokens over the seconds from its first call
to the last token, the prompt's prefill included); llama-bench's its avg_ts. Medians and their
ratio are printed, with the thread count qkv chose each round: a default that picks one thread
of two after the other contender's run (a lagging load average did) shows here, not in a
benchmark that passes --threads.

    .venv/bin/python benchmarks/decode/generate_vs_llama_bench.py --model FILE.gguf [--tokens 256] [--rounds 3]
        [--llama-threads 2] [--prompt "Once upon a time"] [--llama-bench PATH] [--json PATH]

A model that stops early (an end token) is timed over the tokens it wrote; the count is printed.
Build llama-bench as benchmarks/README.md says ("llama.cpp's tools").
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
import llama_tools  # noqa: E402

QKV = Path(sys.executable).with_name("qkv")
RATE = re.compile(r"(\d+) tokens in ([0-9.]+) s: ([0-9.]+) tokens/s \((.*)\)")


def qkv_run(model: str, prompt: str, tokens: int) -> dict[str, float]:
    """One `qkv generate` process with no flags -> its tokens/s, token count and threads."""
    done = subprocess.run([str(QKV), "generate", "--model", model, "--prompt", prompt, "--max-new-tokens",
                           str(tokens)], capture_output=True, text=True, timeout=900)
    found = RATE.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"qkv generate failed ({done.returncode}): {done.stderr[-2000:]}")
    threads = re.search(r"(\d+) threads?", found.group(4))
    rate, count = float(found.group(3)), int(found.group(1))
    print(f"qkv: {rate:.1f} tokens/s over {count} tokens ({found.group(4)})", flush=True)
    return {"rate": rate, "tokens": count, "threads": float(threads.group(1)) if threads else 0.0}


def llama_run(binary: Path, model: str, tokens: int, threads: int) -> dict[str, float]:
    rate = llama_tools.bench_rate(binary, model, threads, tokens)
    print(f"llama-bench: {rate:.1f} tokens/s", flush=True)
    return {"rate": rate}


def main() -> None:
    parser = harness.parser(__doc__, rounds=3, json=True)
    parser.add_argument("--model", required=True, help="a .gguf file (or 'smollm2')")
    parser.add_argument("--tokens", type=int, default=256, help="new tokens a run (default: %(default)s)")
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--llama-threads", type=int, default=2, help="llama-bench's -t (default: %(default)s)")
    parser.add_argument("--llama-bench", help=f"llama-bench's path (default: {llama_tools.BIN}/llama-bench)")
    args = parser.parse_args()
    binary = llama_tools.tool("llama-bench", args.llama_bench)
    model = args.model
    if model == "smollm2":
        from qkv.models.loader import smollm2_path

        model = str(smollm2_path())
    facts = harness.header("qkv generate (no flags) against llama-bench, whole processes alternated")
    print(f"# {model}; {args.tokens} tokens; llama-bench -t {args.llama_threads}", flush=True)
    runs = harness.alternate_own({"qkv": lambda: qkv_run(model, args.prompt, args.tokens),
                                  "llama-bench": lambda: llama_run(binary, model, args.tokens, args.llama_threads)},
                                 rounds=args.rounds)
    ratio = harness.median_ratio("qkv", runs["qkv"]["rate"], "llama-bench", runs["llama-bench"]["rate"])
    qkv_rate, llama_rate = harness.median(runs["qkv"]["rate"]), harness.median(runs["llama-bench"]["rate"])
    threads = ", ".join(str(int(t)) for t in runs["qkv"]["threads"])
    print(f"median qkv generate {qkv_rate:.1f} tokens/s (threads chosen: {threads}; tokens "
          f"{', '.join(str(int(t)) for t in runs['qkv']['tokens'])}), llama-bench {llama_rate:.1f} tokens/s, "
          f"ratio {ratio.value:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": facts, "model": model, "tokens": args.tokens, "runs": runs,
                                         "ratio": ratio.value}, indent=2))


if __name__ == "__main__":
    main()
