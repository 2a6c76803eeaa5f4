"""`qkv serve` as a command: it prints its URL, answers, and stops on SIGINT."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .conftest import free_port


def test_serve_command_prints_its_url_and_answers(tiny_folder: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "qkv", "serve", "--model", str(tiny_folder), "--port", str(port), "--max-batch", "2",
         "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        assert f"http://127.0.0.1:{port}" in line
        deadline = time.monotonic() + 30
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()  # type: ignore[union-attr]
                time.sleep(0.1)
        assert health.json()["status"] == "ok"
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                            json={"model": tiny_folder.name, "prompt": "The cat", "max_tokens": 3})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] <= 3
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_bad_port_is_one_line(tiny_folder: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "qkv", "serve", "--model", str(tiny_folder), "--port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--port" in result.stderr
