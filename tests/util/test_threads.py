"""qkv.util.threads: the default thread count is the idle cores, and every command takes --threads."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qkv.cli.main import main
from qkv.util.threads import CpuClock, apply_threads, idle_cores, one_thread, other_busy_cores, usable_cores


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_idle_cores_are_the_usable_cores_less_the_others_busy_ones() -> None:
    idle = idle_cores()
    assert usable_cores() == len(os.sched_getaffinity(0))
    assert 1 <= idle <= usable_cores()


def test_other_busy_cores_is_the_machines_busy_time_less_this_processs_over_the_wall_time() -> None:
    start = CpuClock(at=10.0, busy=100.0, own=5.0)
    # 2 s of wall time, 3.0 busy core-seconds of which this process's 1.0: one core kept busy by others
    assert other_busy_cores(start, CpuClock(at=12.0, busy=103.0, own=6.0)) == pytest.approx(1.0)
    assert other_busy_cores(start, CpuClock(at=12.0, busy=101.0, own=6.0)) == 0.0  # only this process ran
    assert other_busy_cores(start, CpuClock(at=10.0, busy=101.0, own=5.0)) is None  # no wall time
    assert other_busy_cores(CpuClock(10.0, None, 5.0), CpuClock(12.0, None, 6.0)) is None  # no /proc/stat


def test_a_real_reading_counts_this_processs_own_spinning_as_its_own() -> None:
    """Spinning on this thread is this process's CPU time: /proc/stat sees it among the busy
    time, and the cores other programs kept busy leave room for it (whatever else runs)."""
    start = CpuClock.now()
    until = start
    while until.own - start.own < 0.2 and until.at - start.at < 10.0:  # a fifth of a CPU-second, however shared
        until = CpuClock.now()
    own, wall = until.own - start.own, until.at - start.at
    assert until.busy is not None and start.busy is not None
    assert own >= 0.2 and until.busy - start.busy >= own - 0.05  # /proc/stat saw the spin (clock ticks apart)
    others = other_busy_cores(start, until)
    assert others is not None and 0.0 <= others <= usable_cores() - own / wall + 0.1


def _cpu_seconds_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def test_another_programs_spinning_is_counted_among_the_busy_cores() -> None:
    """A child spinning on a core during the window is another program: its CPU time is among
    the cores other programs kept busy (which may hold more: whatever else runs here)."""
    spin = "import time\nend = time.monotonic() + 2.0\nwhile time.monotonic() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.4)  # its interpreter has started and spins
        start, child_start = CpuClock.now(), _cpu_seconds_of(child.pid)
        time.sleep(0.6)
        until, child_until = CpuClock.now(), _cpu_seconds_of(child.pid)
    finally:
        child.wait(timeout=60)
    others = other_busy_cores(start, until)
    share = (child_until - child_start) / (until.at - start.at)
    assert share > 0.3  # it ran
    assert others is not None and share - 0.15 <= others <= usable_cores() + 0.15


def test_apply_threads_sets_torchs_count() -> None:
    assert apply_threads(1) == 1 and torch.get_num_threads() == 1
    chosen = apply_threads(None)
    assert torch.get_num_threads() == chosen and 1 <= chosen <= usable_cores()
    assert apply_threads(None, processes=64) == 1  # torchrun's processes share the idle cores
    since = CpuClock.now()  # a command's reading from before it imported torch
    assert 1 <= apply_threads(None, since=since) == torch.get_num_threads() <= usable_cores()


def test_the_affinity_mask_bounds_the_default() -> None:
    """A process pinned to one core never picks more than one thread (a real taskset)."""
    probe = "from qkv.util.threads import idle_cores, usable_cores; print(usable_cores(), idle_cores())"
    result = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=60)
    if result.returncode != 0 and "taskset" in result.stderr:
        pytest.skip("taskset is not available")
    assert result.stdout.split() == ["1", "1"]


@pytest.mark.parametrize("command", [
    ["explain"], ["generate", "--prompt", "x"], ["chat"], ["perplexity", "--data", "x.txt"],
    ["train", "--data", "x.txt", "--out", "never-made"],
])
def test_every_command_rejects_zero_threads(command: list[str], capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([*command, "--threads", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--threads must be at least 1, got 0" in err
    assert not (tmp_path / "never-made").exists()


def test_the_count_follows_the_load_while_a_process_lives(monkeypatch) -> None:
    """FollowIdleCores looks again over the window since its last look: other programs keeping
    every core busy -> one thread, quiet again -> every core. What other programs do is the
    machine's, which a test cannot set: the usable cores' busy time is given here."""
    from qkv.util import threads

    cores = usable_cores()
    busy = [0.0]
    last = [time.monotonic()]

    def busy_seconds() -> float:  # every usable core busy since the last reading, or none
        now = time.monotonic()
        busy[0] += (now - last[0]) * cores * load[0]
        last[0] = now
        return busy[0]

    load = [1.0]
    monkeypatch.setattr(threads, "_busy_seconds", busy_seconds)
    follow = threads.FollowIdleCores(every=0.0)
    time.sleep(0.05)
    assert follow.poll() == 1 and torch.get_num_threads() == 1
    load[0] = 0.0
    time.sleep(0.05)
    assert follow.poll() == cores == torch.get_num_threads()
    slow = threads.FollowIdleCores(every=3600.0)
    assert slow.poll() == cores  # the first poll looks
    load[0] = 1.0
    time.sleep(0.05)
    assert slow.poll() == torch.get_num_threads() == cores  # not yet time to look again


def test_release_openmp_workers_lets_the_calling_threads_team_go() -> None:
    """A thread that ran a parallel region holds OpenMP workers (threads of this process);
    release_openmp_workers ends them, and a later region starts them again and computes the
    same sum (a fresh process: the count of its threads is this test's to read)."""
    probe = """
import os, torch
from qkv.util.threads import release_openmp_workers
torch.set_num_threads(3)
before = len(os.listdir("/proc/self/task"))
x = torch.arange(4_000_000, dtype=torch.float64)
first = float(x.sin().sum())
with_team = len(os.listdir("/proc/self/task"))
released = release_openmp_workers()
after = len(os.listdir("/proc/self/task"))
again = float(x.sin().sum())
print(before, with_team, released, after, first == again, len(os.listdir("/proc/self/task")))
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    before, with_team, released, after, same, restarted = result.stdout.split()
    if released != "True":
        pytest.skip("this torch's OpenMP runtime has no omp_pause_resource_all")
    assert int(with_team) >= int(before) + 2  # two workers beside the calling thread
    assert int(after) == int(with_team) - 2 and same == "True" and int(restarted) == int(with_team)


def test_one_thread_runs_torch_on_the_calling_thread_and_restores_the_count() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError), one_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("an error inside still restores the count")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
