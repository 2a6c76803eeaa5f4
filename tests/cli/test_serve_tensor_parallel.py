"""`qkv serve --tensor-parallel 2` on loopback: rank 0 serves HTTP and leads every step, rank 1
follows (qkv.runtime.tensor_parallel_steps). Concurrent greedy requests get one process's
completions; rank 0's stop ends rank 1; a rank that dies is one line on the other, never a hang.

The ranks are plain processes with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...),
as tests/models/tensor_parallel/ranks.py starts them: torchrun's agent would stop every rank
itself when one dies, which would hide what qkv does. Every wait is bounded; every process is
killed at the end.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.models.conftest import save_tiny
from tests.serve_process import free_port, serve_process

PROMPTS = ["Keys, queries and values", "Your journey starts"]


@dataclass
class Ranks:
    url: str
    procs: list[subprocess.Popen]
    logs: list[Path]

    def said(self, rank: int) -> str:
        return self.logs[rank].read_text()

    def wait(self, rank: int, timeout: float = 30) -> int:
        return self.procs[rank].wait(timeout=timeout)


@contextmanager
def serve_ranks(model: Path, tmp_path: Path, *flags: str, n: int = 2) -> Iterator[Ranks]:
    port, master = free_port(), free_port()
    procs, logs = [], []
    try:
        for rank in range(n):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                   "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master),
                   "OMP_NUM_THREADS": "1"}
            logs.append(tmp_path / f"rank{rank}.log")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "qkv", "serve", "--model", str(model), "--port", str(port),
                 "--tensor-parallel", str(n), *flags], env=env, stdout=subprocess.DEVNULL,
                stderr=logs[-1].open("w"), text=True,
                # As from a terminal: Ctrl-C raises KeyboardInterrupt. A process started with SIGINT
                # ignored (a background job's children) keeps ignoring it, and exits 0 on it.
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(url + "/health", timeout=2)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    said = " | ".join(log.read_text()[-2000:] for log in logs)
                    raise RuntimeError(f"the ranks did not start: {said}")
                time.sleep(0.2)
        yield Ranks(url, procs, logs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def _complete(url: str, prompt: str, max_tokens: int = 12) -> dict:
    name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=60).json()


def _concurrently(url: str) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: _complete(url, p), PROMPTS))
    return [answer["choices"][0]["text"] for answer in answers]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny("llama", folder)  # 2 KV heads
    return folder


def test_two_ranks_serve_one_process_completions_and_stop_together(tiny: Path, tmp_path: Path) -> None:
    with serve_process(tiny, "--dtype", "float32") as one:
        expected = _concurrently(one.url)
    with serve_ranks(tiny, tmp_path, "--dtype", "float32") as ranks:
        assert _concurrently(ranks.url) == expected
        assert _concurrently(ranks.url) == expected  # rows released and taken again (prefix reuse on)
        models = httpx.get(ranks.url + "/v1/models", timeout=10).json()
        assert "tensor-parallel over 2 processes" in models["data"][0]["qkv"]["kernels"]
        traced = httpx.post(ranks.url + "/explorer/trace", json={"text": "Keys"}, timeout=30)
        assert traced.status_code == 400 and "--tensor-parallel" in traced.json()["error"]["message"]
        assert _concurrently(ranks.url) == expected  # the refused trace left the ranks in step
        ranks.procs[0].send_signal(signal.SIGINT)
        assert ranks.wait(0) == 130 and ranks.wait(1) == 0  # rank 1 leaves on rank 0's stop plan
        assert "error" not in ranks.said(1)


def test_a_follower_that_dies_mid_request_is_an_error_answer_and_one_line(tiny: Path, tmp_path: Path) -> None:
    with serve_ranks(tiny, tmp_path, "--dtype", "float32") as ranks:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(_complete, ranks.url, PROMPTS[0], 100)
            time.sleep(0.3)
            ranks.procs[1].kill()
            body = answer.result(timeout=60)
        assert "RankLost" in body["error"]["message"], body
        assert ranks.wait(0) == 2
        lines = [line for line in ranks.said(0).splitlines() if "error" in line]
        assert len(lines) == 1 and lines[0].startswith("qkv serve: error: rank 0 of 2: another rank stopped"), lines


def test_rank_zero_gone_ends_the_follower_with_one_line(tiny: Path, tmp_path: Path) -> None:
    with serve_ranks(tiny, tmp_path, "--dtype", "float32") as ranks:
        ranks.procs[0].kill()
        assert ranks.wait(1) == 2
        said = ranks.said(1).strip().splitlines()
        assert said == [said[-1]] and said[-1].startswith("qkv serve: error: rank 1 of 2: another rank stopped"), said
