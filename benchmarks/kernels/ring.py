"""Ring attention on N = 1, 2, 4 processes of this machine: time, bytes sent, peak keys/values.

Spawns N gloo processes on 127.0.0.1 per setting (torch.multiprocessing), each holding a
zigzag shard of one causal sequence shaped like SmolLM2's attention (9 query heads sharing
3 key/value heads, head size 64, float32), and times forward + backward of ring attention
(median of --rounds after one warm-up; one contender per setting, so nothing alternates:
the medians are benchmarks/harness.py's Measurements). Reports per rank: the block compute
time, the bytes it sent (keys/values forward, keys/values and their float32 gradients
backward) and the peak bytes of keys/values it held at once (own shard + block in use +
block arriving).

    .venv/bin/python benchmarks/kernels/ring.py --seq-len 4096 --rounds 3 --json benchmarks/kernels/ring.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402
from qkv.attention.ring import Ring, ShardLayout, ring_attention  # noqa: E402


def worker(rank: int, n: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=timedelta(seconds=300))
    layout = ShardLayout(args.seq_len, n, "zigzag")
    t = layout.length(rank)
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 9, t, 64, generator=g, requires_grad=True)
    k = torch.randn(1, 3, t, 64, generator=g, requires_grad=True)
    v = torch.randn(1, 3, t, 64, generator=g, requires_grad=True)
    dout = torch.randn(1, 9, t, 64, generator=g)
    forward, total = [], []
    for i in range(args.rounds + 1):
        ring = Ring(layout, rank, dist.group.WORLD if n > 1 else None)
        dist.barrier()
        t0 = time.perf_counter()
        out = ring_attention(q, k, v, ring, is_causal=True)
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        if i > 0:
            forward.append(t1 - t0)
            total.append(t2 - t0)
    queue.put({
        "rank": rank, "tokens": t, "forward_s": harness.Measurement("forward", t, "tokens", tuple(forward)).median_s,
        "forward_backward_s": harness.Measurement("forward+backward", t, "tokens", tuple(total)).median_s,
        "bytes_sent": ring.stats.bytes_sent,
        "peak_kv_bytes": ring.stats.peak_kv_bytes,
        "own_kv_bytes": 2 * k.numel() * k.element_size(),
    })
    dist.barrier()
    dist.destroy_process_group()


def measure(n: int, args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = harness.free_port()
    procs = [ctx.Process(target=worker, args=(r, n, port, args, queue)) for r in range(n)]
    for p in procs:
        p.start()
    rows = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    parser = harness.parser(__doc__, json=True)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--worlds", default="1,2,4")
    harness.add_rounds(parser, 3, "--repeats", help="timed runs per rank after one warm-up (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    results = {}
    facts = harness.header("ring attention on N processes of this machine")
    print(f"causal ring attention, S={args.seq_len}, H=9, H_kv=3, D=64, float32, zigzag, "
          f"{args.threads} thread(s) per process; per rank: median of {args.rounds}")
    print(f"{'N':>2} {'tokens/rank':>11} {'fwd s':>8} {'fwd+bwd s':>10} {'MB sent':>9} "
          f"{'peak KV MB':>11} {'own KV MB':>10} {'full-seq KV MB':>15}")
    full_kv = 2 * 3 * args.seq_len * 64 * 4 / 1e6
    for n in (int(x) for x in args.worlds.split(",")):
        rows = measure(n, args)
        results[n] = rows
        worst = max(rows, key=lambda r: r["forward_backward_s"])
        print(f"{n:>2} {worst['tokens']:>11} {max(r['forward_s'] for r in rows):>8.3f} "
              f"{worst['forward_backward_s']:>10.3f} {max(r['bytes_sent'] for r in rows) / 1e6:>9.2f} "
              f"{max(r['peak_kv_bytes'] for r in rows) / 1e6:>11.2f} "
              f"{max(r['own_kv_bytes'] for r in rows) / 1e6:>10.2f} {full_kv:>15.2f}")
    if args.json:
        harness.write_json(args.json, {"seq_len": args.seq_len, "threads": args.threads, "repeats": args.rounds,
                                       "results": results}, facts)


if __name__ == "__main__":
    main()
