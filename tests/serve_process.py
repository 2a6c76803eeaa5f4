"""One `qkv serve` subprocess for the tests that need a real server process: on a free
loopback port, waited for until /health answers (bounded), and always stopped (SIGINT,
then kill) when the `with` block ends.

    with serve_process(folder, "--api-key", KEY, log=path) as server:
        httpx.get(server.url + "/health")
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    url: str
    port: int
    process: subprocess.Popen


@contextmanager
def serve_process(model: Path | str, *flags: str, log: Path | None = None, start_s: float = 120.0,
                  port: int | None = None) -> Iterator[ServerProcess]:
    """`qkv serve --model MODEL --port P FLAGS...`; stderr goes to `log` (read back into the
    message if the server does not start), stdout is discarded."""
    port = free_port() if port is None else port
    stderr = log.open("w") if log is not None else subprocess.PIPE
    process = subprocess.Popen([sys.executable, "-m", "qkv", "serve", "--model", str(model), "--port", str(port),
                                *flags], stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    url = f"http://127.0.0.1:{port}"

    def said() -> str:
        if log is not None:
            return log.read_text()
        return process.stderr.read() if process.poll() is not None else ""  # type: ignore[union-attr]

    try:
        deadline = time.monotonic() + start_s
        while True:
            try:
                httpx.get(url + "/health", timeout=2)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or process.poll() is not None:
                    process.kill()
                    process.wait()
                    raise RuntimeError(f"qkv serve did not start: {said()}")
                time.sleep(0.1)
        yield ServerProcess(url, port, process)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if log is not None:
            stderr.close()  # type: ignore[union-attr]
