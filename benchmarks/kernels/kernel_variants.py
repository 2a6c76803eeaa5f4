"""qkv's products in each variant this CPU runs (generic C++, AVX2, AVX-512 VNNI): one
SmolLM2-135M decode token's int8 and int4 products (30 layers of stacked q/k/v 960x576,
o 576x576, stacked gate/up 3072x576, down 576x1536; the head left out), at 1 and 8 rows of
activations, weights out of cache (a copy per layer, 30 copies exceed the last-level
cache). Variants alternate round by round; medians of --rounds.

    .venv/bin/python benchmarks/kernel_variants.py [--rounds 9] [--threads 2]

On a library without variants (before issue 23) the one kernel is timed as "default".
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from qkv.runtime.native import native_kernels
from qkv.runtime.native.ops import int4_linear, int8_linear

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    status = native_kernels()
    if not status.available:
        raise SystemExit(f"qkv's kernels are not available: {status.reason}")
    names = _variants()
    print(f"{status.describe()}, variants {', '.join(names)}, {args.threads} threads, median of {args.rounds}")
    for kind in ("int8", "int4"):
        for rows in (1, 8):
            run = token(kind, rows)
            samples: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(args.rounds):
                for name in names:
                    with _within(name):
                        start = time.perf_counter()
                        run()
                        samples[name].append(time.perf_counter() - start)
            medians = {name: statistics.median(times) * 1e3 for name, times in samples.items()}
            cells = ", ".join(f"{name} {ms:.2f} ms" for name, ms in medians.items())
            print(f"{kind} x {rows} rows, a SmolLM2 token's products: {cells}")


if __name__ == "__main__":
    main()
