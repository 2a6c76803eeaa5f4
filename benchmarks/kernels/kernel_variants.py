"""qkv's products in each variant this CPU runs (generic C++, AVX2, AVX-512 VNNI): one
SmolLM2-135M decode token's int8 and int4 products (30 layers of stacked q/k/v 960x576,
o 576x576, stacked gate/up 3072x576, down 576x1536; the head left out), at 1 and 8 rows of
activations, weights out of cache (a copy per layer, 30 copies exceed the last-level
cache). Variants alternate round by round, who goes first rotating (benchmarks/harness.py:
qkv.bench.measure.timing's `alternate`, no warm-up round); medians of --rounds.

    .venv/bin/python benchmarks/kernels/kernel_variants.py [--rounds 9] [--threads 2] [--json PATH]

On a library without variants (before issue 23) the one kernel is timed as "default".
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
from qkv.runtime.native import native_kernels  # noqa: E402
from qkv.runtime.native.ops import int4_linear, int8_linear  # noqa: E402

LAYERS = 30
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K) per layer


def _variants() -> list[str]:
    try:
        from qkv.runtime.native.ops import variants

        return variants()
    except (ImportError, AttributeError, RuntimeError):
        return ["default"]


def _within(variant: str):
    if variant == "default":
        return nullcontext()
    from qkv.runtime.native.ops import use_variant

    return use_variant(variant)


def token(kind: str, rows: int) -> Callable[[], None]:
    """One token's products of `kind` for `rows` rows: every layer's own copy of the weights."""
    g = torch.Generator().manual_seed(0)
    calls = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            x = torch.randn(rows, k, generator=g)
            if kind == "int8":
                w, s = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n, generator=g)
                calls.append(lambda x=x, w=w, s=s: int8_linear(x, w, s))
            else:
                q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
                d, m = torch.rand(n, k // 32, generator=g).half(), torch.randn(n, k // 32, generator=g).half()
                calls.append(lambda x=x, q=q, d=d, m=m: int4_linear(x, q, d, m))

    def run() -> None:
        for call in calls:
            call()

    return run


def within(variant: str, run: Callable[[], None]) -> Callable[[], None]:
    """`run` under `variant`: the switch itself is timed too (a dictionary lookup)."""

    def call() -> None:
        with _within(variant):
            run()

    return call


def main() -> None:
    parser = harness.parser(__doc__, rounds=9, threads=2, json=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    facts = harness.header("kernel variants: one SmolLM2 token's products")
    status = native_kernels()
    if not status.available:
        raise SystemExit(f"qkv's kernels are not available: {status.reason}")
    names = _variants()
    print(f"{status.describe()}, variants {', '.join(names)}, {args.threads} threads, median of {args.rounds}")
    results = {}
    for kind in ("int8", "int4"):
        for rows in (1, 8):
            run = token(kind, rows)
            measured = harness.alternate({name: within(name, run) for name in names}, work=1, unit="tokens",
                                         repeats=args.rounds, warmup=0)
            cells = ", ".join(f"{name} {m.median_s * 1e3:.2f} ms" for name, m in measured.items())
            print(f"{kind} x {rows} rows, a SmolLM2 token's products: {cells}", flush=True)
            results[f"{kind} x {rows} rows"] = harness.summary(measured.values())
    if args.json:
        harness.write_json(args.json, {"kernels": status.describe(), "variants": names, "threads": args.threads,
                                       "rounds": args.rounds, "products": results}, facts)


if __name__ == "__main__":
    main()
