"""Start N ranks of a script on loopback, as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment), but as plain processes the test owns: every wait bounded,
every process killed at the end, and a dead rank leaves the others running to say so
(torchrun's agent would stop them first)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).with_name("rank_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Finished:
    codes: list[int]
    stderr: list[str]


def start_ranks(n: int, *argv: str, timeout: float = 90.0) -> Finished:
    """Run WORKER with `argv` as ranks 0..n-1; their exit codes and stderr, in rank order."""
    port = free_port()
    procs = []
    try:
        for rank in range(n):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                   "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, str(WORKER), *argv], env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + timeout
        errors = []
        for proc in procs:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            errors.append(err)
        return Finished([p.returncode for p in procs], errors)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
