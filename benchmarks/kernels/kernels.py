"""qkv's decode kernels (qkv.runtime.native) against PyTorch's for the same products, one row of
activations (a decode step), weights out of cache: each call reads another copy of the
weight, enough copies to exceed the last-level cache. Contenders alternate round by round,
who goes first rotating (benchmarks/harness.py: qkv.bench.measure.timing's `alternate`, no
warm-up round), each call of a round running over all the copies; medians of --rounds; GB/s
counts the weight bytes each contender reads.

    .venv/bin/python benchmarks/kernels/kernels.py [--rounds 15] [--threads 2] [--json PATH]

Rows per product (one decode token of each model):
- SmolLM2-135M: stacked q/k/v 960x576, o 576x576, stacked gate/up 3072x576, down 576x1536
  (30 layers each), head 49152x576;
- GPT-2-124M: stacked q/k/v 2304x768, o 768x768, MLP 3072x768 and 768x3072 (12 layers
  each), head 50257x768.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
from qkv.runtime.native import native_kernels  # noqa: E402
from qkv.runtime.native.ops import f32_linear, int4_linear, int8_linear  # noqa: E402

SMOLLM2 = {"qkv": (960, 576, 30), "o": (576, 576, 30), "gate_up": (3072, 576, 30), "down": (576, 1536, 30),
           "head": (49152, 576, 1)}
GPT2 = {"qkv": (2304, 768, 12), "o": (768, 768, 12), "fc": (3072, 768, 12), "proj": (768, 3072, 12),
        "head": (50257, 768, 1)}
LAST_LEVEL_CACHE = 64 * 2**20  # bytes of weight copies to cycle through: more than this machine's 32 MiB L3


RESULTS: dict[str, object] = {}  # what --json writes: every product's measurements


def timed(contenders: dict[str, tuple[Callable[[object], object], list[object]]], rounds: int,
          label: str = "") -> dict[str, float]:
    """Median seconds per call of each contender, alternating round by round (a round's call
    of a contender goes over all its copies: `work` = that many products)."""

    def over_copies(call: Callable[[object], object], copies: list[object]) -> Callable[[], None]:
        def run() -> None:
            for copy in copies:
                call(copy)
        return run

    measured = harness.alternate({name: over_copies(call, copies) for name, (call, copies) in contenders.items()},
                                 work={name: len(copies) for name, (_, copies) in contenders.items()},
                                 unit="products", repeats=rounds, warmup=0)
    RESULTS[label] = harness.summary(measured.values())
    return {name: m.median_s / m.work for name, m in measured.items()}


def copies(make: Callable[[], object], nbytes: int) -> list[object]:
    return [make() for _ in range(max(2, LAST_LEVEL_CACHE // nbytes))]


def smollm2_products(rounds: int) -> None:
    print("SmolLM2 products, one row: microseconds (GB/s of weight read)")
    totals: dict[str, float] = {}
    for name, (n, k, layers) in SMOLLM2.items():
        x, xb = torch.randn(1, k), torch.randn(1, k).bfloat16()
        scales = torch.rand(n)
        int8 = copies(lambda: torch.randint(-127, 128, (n, k), dtype=torch.int8), n * k)
        blocks = copies(lambda: (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
                                 torch.rand(n, k // 32).half(), torch.rand(n, k // 32).half()), n * k * 5 // 8)
        packed = copies(lambda: torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (n, k), dtype=torch.int32), 1), n * k // 2)
        zeros = torch.rand(k // 32, n, 2).bfloat16()
        contenders = {
            "qkv int8": (lambda w: int8_linear(x, w, scales), int8),
            "PyTorch int8": (lambda w: torch.ops.aten._weight_int8pack_mm(xb, w, scales.bfloat16()), int8),
            "qkv int4": (lambda b: int4_linear(x, *b), blocks),
            "PyTorch int4": (lambda p: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p, 32, zeros), packed),
        }
        if name == "head":  # both precisions keep the head at int8
            contenders = {key: value for key, value in contenders.items() if "int8" in key}
        seconds = timed(contenders, rounds, f"SmolLM2 {name} {n}x{k}")
        cells = []
        for contender, value in seconds.items():
            bytes_read = n * k * (5 / 8 if "int4" in contender else 1)
            cells.append(f"{contender} {value * 1e6:7.1f} us ({bytes_read / value / 1e9:4.1f})")
            totals[contender] = totals.get(contender, 0.0) + value * layers
        print(f"  {name:8s} {n}x{k}: " + " | ".join(cells))
    totals["qkv int4"] = totals["qkv int4"] + seconds["qkv int8"]  # int4 models keep an int8 head
    totals["PyTorch int4"] = totals["PyTorch int4"] + seconds["PyTorch int8"]
    print("  a token's products (ms): " + ", ".join(f"{c} {t * 1e3:.2f}" for c, t in totals.items()))


def gpt2_products(rounds: int) -> None:
    print("GPT-2-124M float32 products, one row: microseconds (GB/s of weight read)")
    totals: dict[str, float] = {}
    for name, (n, k, layers) in GPT2.items():
        x = torch.randn(1, k)
        weights = copies(lambda: torch.randn(n, k), n * k * 4)
        input_major = [w.t().contiguous() for w in weights]
        contenders = {
            "qkv float32": (lambda w: f32_linear(x, w), weights),
            "F.linear": (lambda w: F.linear(x, w), weights),
            "x @ W (input-major)": (lambda w: x @ w, input_major),
        }
        seconds = timed(contenders, rounds, f"GPT-2 {name} {n}x{k}")
        cells = []
        for contender, value in seconds.items():
            cells.append(f"{contender} {value * 1e6:8.1f} us ({n * k * 4 / value / 1e9:4.1f})")
            totals[contender] = totals.get(contender, 0.0) + value * layers
        print(f"  {name:5s} {n}x{k}: " + " | ".join(cells))
    print("  a token's products (ms): " + ", ".join(f"{c} {t * 1e3:.2f}" for c, t in totals.items()))


def main() -> None:
    parser = harness.parser(__doc__, rounds=15, threads=2, json=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    facts = harness.header("qkv's decode kernels against PyTorch's, one row, weights out of cache")
    status = native_kernels()
    if not status.available:
        raise SystemExit(f"qkv's kernels are not available here: {status.reason}")
    smollm2_products(args.rounds)
    gpt2_products(args.rounds)
    if args.json:
        harness.write_json(args.json, {"kernels": status.describe(), "rounds": args.rounds, "threads": args.threads,
                                       "products": RESULTS}, facts)


if __name__ == "__main__":
    main()
