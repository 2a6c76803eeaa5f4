"""How many CPU threads torch uses: one choice for every command (`--threads`).

PyTorch starts one thread per core. On a machine where other programs are busy, those
threads wait for each other at every parallel region and decoding can get several times
slower than with one thread. So the default is the number of *idle* cores: the cores this
process may run on (its CPU affinity) minus the load average of the last minute (the
number of threads that were running or ready to run), at least 1. On a quiet machine that
is every core, as torch would choose; on a busy one it leaves the busy cores alone. Give
`--threads N` to override it, for example when measuring.

Importing this module does not import torch; `apply_threads` does, when it is called.
"""

from __future__ import annotations

import argparse
import os

from qkv.errors import QkvError


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), or all of them where unknown."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def idle_cores() -> int:
    """Usable cores minus the 1-minute load average, rounded, at least 1."""
    cores = usable_cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this system: assume it is quiet
        return cores
    return max(1, min(cores, cores - round(load)))


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads", type=int, metavar="N",
        help="CPU threads for torch (default: the idle cores, i.e. the usable cores minus the "
        "1-minute load average, at least 1; on a busy machine fewer threads are faster)",
    )


def apply_threads(requested: int | None, *, processes: int = 1) -> int:
    """Set torch's thread count to `requested`, or to this process's share of the idle cores
    when `processes` on this machine share them (torchrun); returns the number."""
    if requested is not None and requested < 1:
        raise QkvError(f"--threads must be at least 1, got {requested}")
    threads = requested if requested is not None else max(1, idle_cores() // max(1, processes))
    import torch

    torch.set_num_threads(threads)
    return threads
