"""`qkv` under torchrun for the CLI's distributed tests: N local processes on a free loopback
port, one thread each, bounded by `timeout` (subprocess kills them past it)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.models.tensor_parallel.ranks import free_port


def torchrun(n: int, *argv: str, timeout: int = 120, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-addr",
         "127.0.0.1", "--master-port", str(free_port()), "-m", "qkv", *argv],
        env=env, capture_output=True, text=True, timeout=timeout, input=stdin,
    )
