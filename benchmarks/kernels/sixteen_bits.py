"""qkv's F16 / BF16 block products (a matrix kept in its 16 bits, float32 activations as they
are) against torch's F.linear on the same weights converted to float32 and to bfloat16 (x in
bfloat16 too: torch's own 16-bit path): the time of one product y (M, N) = x (M, K) @ w^T,
M = 1 (a decode step) or --rows M (a prompt's prefill), in every variant this CPU runs.

    python benchmarks/kernels/sixteen_bits.py [--rows 1] [--threads 2] [--rounds 5] [--calls 100]

Each cell: the median over rounds of each round's median of `calls` calls after 10 untimed; the
contenders alternate within a round, so a load that comes and goes shares itself out. Ratios
are qkv's time over F.linear float32's (below 1: qkv faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as Q

from qkv.runtime.native.block_ops import block_linear, block_products_status
from qkv.runtime.native.ops import use_variant, variants

SHAPES = [(2048, 2048), (8192, 2048)]  # (N, K)
TYPES = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def median_us(run, calls: int) -> float:
    for _ in range(10):
        run()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    if (reason := block_products_status()) is not None:
        raise SystemExit(f"qkv's block products do not run here: {reason}")
    torch.set_num_threads(args.threads)
    print(f"M = {args.rows}, {args.threads} threads, median us a product (ratio to F.linear float32)")
    for n, k in SHAPES:
        x = torch.randn(args.rows, k)
        w32 = torch.randn(n, k) * 0.02
        xb, wb = x.bfloat16(), w32.bfloat16()
        runs = {"F.linear float32": lambda: F.linear(x, w32), "F.linear bfloat16": lambda: F.linear(xb, wb)}
        for block_type, dtype in TYPES.items():
            blocks = w32.to(dtype).view(torch.uint8).contiguous()  # (N, 2 K): the file's bytes
            for variant in variants():
                def run(blocks=blocks, block_type=block_type, variant=variant) -> None:
                    with use_variant(variant):
                        block_linear(x, blocks, block_type)
                runs[f"qkv {block_type.name} {variant}"] = run
        rounds: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                rounds[name].append(median_us(run, args.calls))
        base = statistics.median(rounds["F.linear float32"])
        print(f"{n} x {k}:")
        for name, values in rounds.items():
            us = statistics.median(values)
            print(f"  {name:24s} {us:9.1f} us  ({us / base:.2f}x)")


if __name__ == "__main__":
    main()
