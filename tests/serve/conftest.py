"""A tiny random Llama with a chat template, saved as a checkpoint folder, and a real
`qkv serve` app under uvicorn on a free loopback port (stopped after the tests)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


API_KEY = "test-key"


@pytest.fixture(scope="session")
def tiny_folder(tiny_chat_folder: Path) -> Path:
    return tiny_chat_folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Running:
    url: str
    served: object
    app: object


@pytest.fixture(scope="module")
def start_server(tiny_folder: Path):
    import uvicorn

    from qkv.serve.http.app import build_app
    from qkv.serve.api.schemas import Limits
    from qkv.serve.http.server import load_served

    started: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(*, max_batch: int = 4, max_waiting: int | None = None, api_key: str | None = API_KEY,
              limits: Limits = Limits(max_tokens=64), precision: str = "float32") -> Running:
        served = load_served(str(tiny_folder), precision=precision, max_batch=max_batch, max_waiting=max_waiting)
        app = build_app(served, limits=limits, api_key=api_key)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        started.append((server, thread))
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return Running(f"http://127.0.0.1:{port}", served, app)

    yield start
    for server, thread in started:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(start_server) -> Iterator[Running]:
    yield start_server()
