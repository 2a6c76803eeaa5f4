"""How many CPU threads torch uses: one choice for every command (`--threads`).

PyTorch starts one thread per core. On a machine where other programs are busy, those
threads wait for each other at every parallel region and decoding can get several times
slower than with one thread. So the default is the number of *idle* cores: the cores this
process may run on (its CPU affinity) less the cores other programs kept busy just now, at
least 1. On a quiet machine that is every core, as torch would choose; on a busy one it
leaves the busy cores alone. Give `--threads N` to override it, for example when measuring.

"Just now" is a window measured, not the kernel's 1-minute load average: that average still
counts a program that ended 30 seconds ago (a 2-core job leaves it near 1 for about a minute),
so a command started after another one ran on one thread of two at half speed. The window
is read from /proc/stat (the usable cores' busy time: user, nice, system, interrupts, and
steal, time the hypervisor gave away) less this process's own CPU time over the same wall
time (`CpuClock`, `other_busy_cores`). A command starts the window before it imports torch
(seconds that cost nothing extra to watch) and passes it to `apply_threads(since=...)`;
without one, `idle_cores` watches MIN_WINDOW seconds. Where /proc/stat cannot be read
(not Linux), the 1-minute load average less this process's own share stands in.

A long-lived process (`qkv serve`) cannot keep one snapshot taken at start: a server
started while the machine was busy would run on one thread for its whole life.
`FollowIdleCores.poll()`, called between steps, looks again every few seconds, over the
window since its last look.

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
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

from qkv.errors import QkvError


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), or all of them where unknown."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


MIN_WINDOW = 0.1  # seconds watched at least for the cores other programs keep busy (10 clock ticks)
_IDLE_FIELDS = (3, 4)  # /proc/stat's idle and iowait columns; the others are busy time (guest is within user)


def _cpu_seconds() -> float:
    """This process's CPU seconds so far, every thread's."""
    times = os.times()
    return times.user + times.system


def _busy_seconds() -> float | None:
    """Seconds the usable cores have spent busy since boot (/proc/stat), None where unreadable."""
    try:
        cpus = os.sched_getaffinity(0)
        with open("/proc/stat", encoding="ascii") as stat:
            lines = [line.split() for line in stat if line.startswith("cpu") and line[3].isdigit()]
    except (AttributeError, OSError):
        return None
    ticks = 0
    for fields in lines:
        if int(fields[0][3:]) in cpus:
            values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
            ticks += sum(v for i, v in enumerate(values) if i not in _IDLE_FIELDS)
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuClock:
    """One reading of the CPU time spent so far: by the usable cores (busy, None where
    /proc/stat cannot be read) and by this process (own), at wall time `at`."""

    at: float
    busy: float | None
    own: float

    @staticmethod
    def now() -> CpuClock:
        return CpuClock(time.monotonic(), _busy_seconds(), _cpu_seconds())


def other_busy_cores(since: CpuClock, until: CpuClock) -> float | None:
    """Cores other programs kept busy between two readings: the usable cores' busy time less
    this process's own, over the wall time; None without /proc/stat or an empty window."""
    wall = until.at - since.at
    if since.busy is None or until.busy is None or wall <= 0:
        return None
    return max(0.0, (until.busy - since.busy) - (until.own - since.own)) / wall


def idle_cores(since: CpuClock | None = None) -> int:
    """Usable cores less the cores other programs kept busy since `since` (watched for at least
    MIN_WINDOW seconds), rounded, at least 1 (module docstring)."""
    return _idle_between(*_watched(since))


def _watched(since: CpuClock | None) -> tuple[CpuClock, CpuClock]:
    """A window from `since` (None: now) to a reading at least MIN_WINDOW seconds later."""
    start = since if since is not None else CpuClock.now()
    left = MIN_WINDOW - (time.monotonic() - start.at)
    if left > 0 and start.busy is not None:
        time.sleep(left)
    return start, CpuClock.now()


def _idle_between(start: CpuClock, until: CpuClock) -> int:
    others = other_busy_cores(start, until)
    if others is None:  # no /proc/stat: the load average, less this process's share of it
        others = _load_average() - (until.own - start.own) / max(until.at - start.at, 1e-3)
    cores = usable_cores()
    return max(1, min(cores, cores - round(max(0.0, others))))


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this system: assume it is quiet
        return 0.0


class FollowIdleCores:
    """Keeps torch's thread count at this process's share of the idle cores while the
    machine's load changes: `poll()` looks again at most every `every` seconds, over the
    window since its last look (the first: since the object was made)."""

    def __init__(self, *, every: float = 5.0, processes: int = 1) -> None:
        self.every, self.processes = every, max(1, processes)
        self.threads = 0  # not set yet: the first poll sets it, on the thread that polls
        self._since = CpuClock.now()

    def poll(self) -> int:
        """torch's thread count for the calling thread (the one that runs the model), looked
        at again when `every` seconds have passed since the last look."""
        if self.threads and time.monotonic() - self._since.at < self.every:
            return self.threads
        import torch

        start, self._since = _watched(self._since)
        threads = max(1, _idle_between(start, self._since) // self.processes)
        if threads != self.threads or threads != torch.get_num_threads():
            torch.set_num_threads(threads)
            self.threads = threads
        return threads


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads", type=int, metavar="N",
        help="CPU threads for torch (default: the idle cores, i.e. the usable cores less those other "
        "programs kept busy while the command started, at least 1; on a busy machine fewer threads are faster)",
    )


def apply_threads(requested: int | None, *, processes: int = 1, since: CpuClock | None = None) -> int:
    """Set torch's thread count to `requested`, or to this process's share of the idle cores
    when `processes` on this machine share them (torchrun), the cores other programs kept busy
    watched since `since` (a command's reading from before it imported torch); returns the number."""
    if requested is not None and requested < 1:
        raise QkvError(f"--threads must be at least 1, got {requested}")
    threads = requested if requested is not None else max(1, idle_cores(since) // max(1, processes))
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
