"""qkv's default decode against llama.cpp's own `llama-bench` on the same GGUF file.

llama-bench's `-p 0 -n 128` is pure decode: 128 tokens after an empty prompt, the median of
its repetitions. qkv's side is the path `qkv generate` takes without flags
(`load_for_generation`: the file's default precision, compiled, qkv's kernels), timed over
the same 128 decode steps after a one-token prompt (its prefill excluded). The two alternate
`--rounds` times in one run, who goes first rotating (benchmarks/harness.py: each side
reports its own seconds, the rounds are qkv.bench.measure.timing's `alternate`); medians
and their ratio are printed.

Two more rows, each alternated the same way:
- prefill: a `--prefill`-token prompt (default 512) through qkv's session in one call, after
  one untimed prompt (llama-bench also warms up), against llama-bench's `-p 512 -n 0` (its
  pp512); `--prefill 0` skips it;
- bandwidth: bytes read per decoded token times tokens/s, as a fraction of this machine's
  read bandwidth measured in the same run (qkv.bench.measure.bandwidth): qkv's bytes are its
  prepared model's weights (qkv.bench.measure.roofline), llama.cpp's the file's tensors
  (llama_tools.file_bytes_per_token). A decode far below 1.0 is compute- or overhead-bound.

    .venv/bin/python benchmarks/decode/decode_vs_llama_bench.py --llama-bench /work/peers/build/bin/llama-bench \\
        [--model smollm2 | FILE.gguf] [--threads 2] [--rounds 3] [--dtype auto | int8 | ...] [--prefill 512] [--json PATH]

The >= 1B files: benchmarks/gguf/llama_1b_files.py makes them.

Build llama-bench as benchmarks/README.md says ("llama.cpp's tools": llama.cpp's own tools,
this CPU's best flags); without --llama-bench it is looked for in llama_tools.BIN.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
import llama_tools  # noqa: E402
from qkv.attention.caches.kv_cache import SlotKVCache  # noqa: E402
from qkv.bench.measure import measure_read_bandwidth, weight_bytes_per_token  # noqa: E402
from qkv.generation import continue_from, warm_up  # noqa: E402
from qkv.models.loader import named_model, smollm2_path  # noqa: E402
from qkv.names import CHOICES, DEFAULT_PRECISION  # noqa: E402
from qkv.runtime import DecodeSession, DecodeSetup, load_for_generation  # noqa: E402

TOKENS = 128


def qkv_seconds(model: torch.nn.Module, setup: DecodeSetup, tokens: int) -> float:
    """Seconds of `tokens` decode steps after a one-token prompt (prefill not counted), in a
    session of slots as `qkv generate` decodes."""
    prompt = torch.zeros(1, dtype=torch.long)
    with DecodeSession(model, capacity=tokens + 8, kind=SlotKVCache, setup=setup) as session:  # generate's kind
        logits = session.prefill_row(0, prompt)[None]  # (1, V)
        start = time.perf_counter()
        for _ in continue_from(session, logits, tokens + 1):  # tokens + 1 choices: `tokens` decode steps
            pass
        seconds = time.perf_counter() - start
    print(f"qkv: {tokens / seconds:.1f} tokens/s", flush=True)
    return seconds


def qkv_prefill_seconds(model: torch.nn.Module, setup: DecodeSetup, tokens: int) -> float:
    """Seconds of one `tokens`-token prompt through a session (qkv generate's prefill)."""
    prompt = torch.randint(0, 1000, (tokens,), generator=torch.Generator().manual_seed(0))
    with DecodeSession(model, capacity=tokens + 8, kind=SlotKVCache, setup=setup) as session:
        start = time.perf_counter()
        session.prefill_row(0, prompt)
        seconds = time.perf_counter() - start
    print(f"qkv prefill: {tokens / seconds:.1f} tokens/s", flush=True)
    return seconds


def llama_prefill_seconds(binary: Path, path: str, threads: int, tokens: int) -> float:
    rate = llama_tools.prompt_rate(binary, path, threads, tokens)
    print(f"llama-bench pp{tokens}: {rate:.1f} tokens/s", flush=True)
    return tokens / rate


def llama_seconds(binary: Path, path: str, threads: int, tokens: int) -> float:
    """llama-bench's own median rate for `tokens` decode steps, as the seconds they took."""
    rate = llama_tools.bench_rate(binary, path, threads, tokens)
    print(f"llama-bench: {rate:.1f} tokens/s", flush=True)
    return tokens / rate


def main() -> None:
    parser = harness.parser(__doc__, rounds=3, threads=2, json=True)
    parser.add_argument("--llama-bench", help=f"path of llama.cpp's llama-bench (default: {llama_tools.BIN}/llama-bench)")
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a .gguf file")
    parser.add_argument("--dtype", choices=CHOICES, default=DEFAULT_PRECISION,
                        help="qkv's decode precision, as `qkv generate --dtype` (default: the file's)")
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill row (0: skip it)")
    parser.add_argument("--variant", choices=("generic", "avx2", "avx512"),
                        help="cap qkv's kernels at this variant (an AVX2-only CPU's path on an AVX-512 one; pair it "
                             "with an AVX2-only llama-bench)")
    args = parser.parse_args()
    bench = llama_tools.tool("llama-bench", args.llama_bench)
    path = str(smollm2_path()) if named_model(args.model) else args.model
    torch.set_num_threads(args.threads)
    facts = harness.header("decode: qkv's default path against llama-bench -p 0 -n 128 on the same file")
    if args.variant is not None:  # before the load, which decides the layouts for the kernels that will run them
        from qkv.runtime.native.build import native_kernels
        from qkv.runtime.native.ops import active_variant

        native_kernels()  # the library that has the op
        torch.ops.qkv.set_variant.default(args.variant)  # for the whole process (what use_variant does in a block)
        print(f"qkv: kernels capped at {active_variant()}", flush=True)
    model, _, setup = load_for_generation(path, precision=args.dtype)
    warm_up(model, capacity=TOKENS + 8, setup=setup)
    print(f"qkv: {setup.describe()}; {os.cpu_count()} cores, {args.threads} threads; {path}", flush=True)
    measured = harness.self_timed({"qkv": lambda: qkv_seconds(model, setup, TOKENS),
                                   "llama-bench": lambda: llama_seconds(bench, path, args.threads, TOKENS)},
                                  work=TOKENS, unit="tokens", rounds=args.rounds)
    ratios = harness.ratios_over(measured, "llama-bench")
    print(harness.table(measured.values(), ratios))
    q, l = measured["qkv"].rate, measured["llama-bench"].rate
    print(f"median qkv {q:.1f} tokens/s, llama-bench {l:.1f} tokens/s, ratio {ratios[0].value:.2f}x")
    result = {"model": path, "qkv": setup.describe(), "threads": args.threads, "llama_bench": str(bench),
              **harness.summary(measured.values(), ratios)}
    bandwidth = measure_read_bandwidth()
    qkv_bytes, llama_bytes = weight_bytes_per_token(model), llama_tools.file_bytes_per_token(path)
    shares = {"qkv": qkv_bytes * q / 1e9 / bandwidth.gb_per_s, "llama-bench": llama_bytes * l / 1e9 / bandwidth.gb_per_s}
    print(f"read bandwidth {bandwidth.gb_per_s:.1f} GB/s ({bandwidth.threads} threads); bytes a token: qkv "
          f"{qkv_bytes / 1e6:.1f} MB, llama.cpp {llama_bytes / 1e6:.1f} MB; share of the bandwidth: qkv "
          f"{shares['qkv']:.2f}, llama-bench {shares['llama-bench']:.2f}")
    result["bandwidth"] = {"gb_per_s": bandwidth.gb_per_s, "qkv_bytes_per_token": qkv_bytes,
                           "llama_bytes_per_token": llama_bytes, "share": shares}
    if args.prefill > 0:
        # one untimed prompt first, as llama-bench runs one before its pp rounds: the first
        # 512-row call grows the layer kernel's work buffers and touches the prompt cache's pages
        print("qkv prefill warm-up (not counted):", end=" ", flush=True)
        qkv_prefill_seconds(model, setup, args.prefill)
        prefill = harness.self_timed({"qkv": lambda: qkv_prefill_seconds(model, setup, args.prefill),
                                      "llama-bench": lambda: llama_prefill_seconds(bench, path, args.threads, args.prefill)},
                                     work=args.prefill, unit="tokens", rounds=args.rounds)
        prefill_ratios = harness.ratios_over(prefill, "llama-bench")
        print(harness.table(prefill.values(), prefill_ratios))
        print(f"prefill {args.prefill}: qkv {prefill['qkv'].rate:.1f} tokens/s, llama-bench pp{args.prefill} "
              f"{prefill['llama-bench'].rate:.1f}, ratio {prefill_ratios[0].value:.2f}x")
        result["prefill"] = harness.summary(prefill.values(), prefill_ratios)
    if args.json:
        harness.write_json(args.json, result, facts)


if __name__ == "__main__":
    main()
