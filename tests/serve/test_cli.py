"""`qkv serve` as a command: it says what it serves and where, answers, and says so when it
stops (SIGINT or SIGTERM)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import free_port


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_serve_command_says_what_it_serves_answers_and_says_it_stopped(tiny_folder: Path, stop: int) -> None:
    """The start-up line names the file, the precision and the kernels (as `qkv generate`
    says its setup); the last line says it stopped and how many requests it answered,
    on Ctrl-C and on SIGTERM alike."""
    from qkv.runtime.native import native_kernels

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "qkv", "serve", "--model", str(tiny_folder), "--port", str(port), "--max-batch", "2",
         "--threads", "1", "--dtype", "int8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    answered = 0
    try:
        setup = process.stdout.readline()  # type: ignore[union-attr]
        assert str(tiny_folder) in setup and "int8 weights" in setup and native_kernels().describe() in setup, setup
        line = process.stdout.readline()  # type: ignore[union-attr]
        assert f"http://127.0.0.1:{port}" in line
        deadline = time.monotonic() + 30
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                answered += 1
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()  # type: ignore[union-attr]
                time.sleep(0.1)
        assert health.json()["status"] == "ok"
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                            json={"model": tiny_folder.name, "prompt": "The cat", "max_tokens": 3})
        answered += 1
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] <= 3
    finally:
        process.send_signal(stop)
        try:
            rest, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            rest, _ = process.communicate()
    assert rest.strip().splitlines()[-1] == f"qkv serve: stopped ({answered} requests served)"


def test_bad_port_is_one_line(tiny_folder: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "qkv", "serve", "--model", str(tiny_folder), "--port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--port" in result.stderr
