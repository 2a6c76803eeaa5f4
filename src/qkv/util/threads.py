"""How many CPU threads torch uses: one choice for every command (`--threads`).

PyTorch starts one thread per core. On a machine where other programs are busy, those
threads wait for each other at every parallel region and decoding can get several times
slower than with one thread. So the default is the number of *idle* cores: the cores this
process may run on (its CPU affinity) minus the load average of the last minute (the
number of threads that were running or ready to run), at least 1. On a quiet machine that
is every core, as torch would choose; on a busy one it leaves the busy cores alone. Give
`--threads N` to override it, for example when measuring.

A long-lived process (`qkv serve`) cannot keep one snapshot taken at start: a server
started while the machine was busy would run on one thread for its whole life.
`FollowIdleCores.poll()`, called between steps, re-evaluates every few seconds; since the
load average counts this process's own running threads too, it subtracts this process's
own CPU use, averaged the way the kernel averages the load (over a minute).

A process that prepares a model on one thread and decodes it on another (`qkv serve`)
calls `release_openmp_workers` on the first when it hands the model over, so that only the
decoding thread keeps a team of OpenMP workers (why: its docstring).

A decode step's small operations (choosing the next tokens from (b, V) logits) run on the
calling thread alone (`one_thread`): split over two threads they wait at each region for the
other one, which a busy core leaves unscheduled for milliseconds (an argmax over 8 rows of
SmolLM2's vocabulary: 24 ms on two threads beside other programs, 1.4 ms on one).

Importing this module does not import torch; `apply_threads` does, when it is called.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import time
from collections.abc import Iterator

from qkv.errors import QkvError


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), or all of them where unknown."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def idle_cores(own_load: float = 0.0) -> int:
    """Usable cores minus the 1-minute load average (less `own_load`, this process's own
    share of it), rounded, at least 1."""
    cores = usable_cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this system: assume it is quiet
        return cores
    return max(1, min(cores, cores - round(max(0.0, load - own_load))))


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


class FollowIdleCores:
    """Keeps torch's thread count at this process's share of the idle cores while the
    machine's load changes: `poll()` re-evaluates at most every `every` seconds."""

    LOAD_WINDOW = 60.0  # seconds: the kernel's 1-minute load average decays over this

    def __init__(self, *, every: float = 5.0, processes: int = 1) -> None:
        self.every, self.processes = every, max(1, processes)
        self.threads = 0  # not set yet: the first poll sets it, on the thread that polls
        self._at, self._cpu = time.monotonic(), _cpu_seconds()
        self._own = 0.0  # this process's running threads, averaged like the load average

    def poll(self) -> int:
        """torch's thread count for the calling thread (the one that runs the model), looked
        at again when `every` seconds have passed since the last look."""
        now = time.monotonic()
        if self.threads and now - self._at < self.every:
            return self.threads
        import torch

        cpu = _cpu_seconds()
        decay = math.exp(-(now - self._at) / self.LOAD_WINDOW)
        self._own = self._own * decay + (cpu - self._cpu) / max(now - self._at, 1e-3) * (1 - decay)
        self._at, self._cpu = now, cpu
        threads = max(1, idle_cores(own_load=self._own) // self.processes)
        if threads != self.threads or threads != torch.get_num_threads():
            torch.set_num_threads(threads)
            self.threads = threads
        return threads


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


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch runs on the calling thread alone inside (module docstring: a step's small
    operations); its thread count is restored after."""
    import torch

    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _openmp_runtimes() -> list[ctypes.CDLL]:
    """The OpenMP runtimes this process has loaded (torch's libgomp, an LLVM or Intel libomp),
    found in the process's own memory map; none where it cannot be read."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith((".so", ".so.1", ".so.5"))}
    except OSError:
        return []
    runtimes = []
    for path in sorted(paths):
        if os.path.basename(path).startswith(("libgomp", "libiomp", "libomp")):
            try:
                runtimes.append(ctypes.CDLL(path))
            except OSError:
                continue
    return runtimes


def release_openmp_workers() -> bool:
    """Let the OpenMP worker threads of the calling thread's parallel regions exit
    (`omp_pause_resource_all`, in every OpenMP runtime loaded); returns whether any could be.

    Why: a server prepares its model on one thread and decodes it on another (the engine's),
    so two teams of OpenMP workers exist, and libgomp, seeing more of its threads than cores,
    stops spinning between parallel regions ("throttled" waits, as OMP_WAIT_POLICY=passive
    would): every one of a decode step's few hundred short regions then wakes its workers
    through the kernel, 2-3x the step's time on two cores. The thread that hands the model to
    another calls this, and the decoding thread's team is the only one left. A parallel region
    the calling thread runs later starts its workers again."""
    released = False
    for runtime in _openmp_runtimes():
        pause = getattr(runtime, "omp_pause_resource_all", None)
        if pause is None:
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        released = pause(1) == 0 or released  # omp_pause_soft: the threads go, the runtime stays usable
    return released
