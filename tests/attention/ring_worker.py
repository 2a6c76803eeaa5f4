"""One rank of the ring-attention tests, started by torchrun from tests/attention/test_ring.py.

Reads the cases (whole-sequence inputs) that the test wrote, runs ring attention on this
rank's shard of each, and saves this rank's outputs and gradients for the test to compare
with single-process attention. Also records the errors of deliberately bad rings.
Usage: python ring_worker.py CASES.pt OUT_DIR
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from qkv.attention.ring import Ring, ShardLayout, ring_attention
from qkv.errors import QkvError


def main(cases_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cases = torch.load(cases_file)
    results: dict[str, object] = {}
    for case in cases:
        layout = ShardLayout(case["q"].shape[2], n, case["sharding"])
        ring = Ring(layout, rank, dist.group.WORLD, kernel=case["kernel"])
        q, k, v = (layout.shard(case[name], rank, dim=2).requires_grad_() for name in "qkv")
        out = ring_attention(q, k, v, ring, is_causal=case["causal"])
        out.backward(layout.shard(case["dout"], rank, dim=2))
        results[case["name"]] = {
            "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "bytes_sent": ring.stats.bytes_sent, "peak_kv_bytes": ring.stats.peak_kv_bytes,
        }
    try:
        Ring(ShardLayout(16, n + 1), rank, dist.group.WORLD)
    except QkvError as error:
        results["mismatched"] = str(error)
    # A neighbour that never answers: rank 0 must give up after its timeout, not hang.
    if rank == 0:
        lonely = Ring(ShardLayout(8, n), 0, dist.group.WORLD, timeout=timedelta(seconds=1))
        x = torch.zeros(1, 1, lonely.layout.length(0), 4)
        started = time.perf_counter()
        try:
            ring_attention(x, x, x, lonely)
        except QkvError as error:
            results["timeout"] = (str(error), time.perf_counter() - started)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    if rank != 0:
        time.sleep(3)  # outlive rank 0's timeout, so that it really waited
    # No orderly teardown: rank 0's abandoned receive would make it wait for a peer that left.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
