"""qkv.util.threads: the default thread count is the idle cores, and every command takes --threads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from qkv.cli.main import main
from qkv.util.threads import apply_threads, idle_cores, one_thread, usable_cores


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_idle_cores_are_the_usable_cores_less_the_load() -> None:
    load = os.getloadavg()[0]
    idle = idle_cores()
    assert usable_cores() == len(os.sched_getaffinity(0))
    assert 1 <= idle <= usable_cores()
    assert abs(idle - max(1, min(usable_cores(), usable_cores() - round(load)))) <= 1  # the load moves


def test_apply_threads_sets_torchs_count() -> None:
    assert apply_threads(1) == 1 and torch.get_num_threads() == 1
    chosen = apply_threads(None)
    assert torch.get_num_threads() == chosen and 1 <= chosen <= usable_cores()
    assert apply_threads(None, processes=64) == 1  # torchrun's processes share the idle cores


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
    """FollowIdleCores re-reads the machine: busy -> one thread, quiet again -> every core.
    The load average is the machine's, which a test cannot set: it is given here."""
    from qkv.util.threads import FollowIdleCores

    load = [float(usable_cores())]
    monkeypatch.setattr(os, "getloadavg", lambda: (load[0], load[0], load[0]))
    follow = FollowIdleCores(every=0.0)
    assert follow.poll() == 1 and torch.get_num_threads() == 1
    load[0] = 0.0
    assert follow.poll() == usable_cores() == torch.get_num_threads()
    slow = FollowIdleCores(every=3600.0)
    assert slow.poll() == usable_cores()  # the first poll looks
    load[0] = float(usable_cores())
    assert slow.poll() == torch.get_num_threads() == usable_cores()  # not yet time to look again


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
