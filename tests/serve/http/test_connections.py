"""The deadline protocol under real uvicorn on a loopback socket: slow or stalled requests are
closed by their deadline, while busy keep-alive connections, pipelined requests and answers
slower than the deadline are served as before; the connection cap answers 503; a port in use
is refused by bind_socket."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from qkv.errors import QkvError
from qkv.serve.http.connections import bind_socket, deadline_protocol

READ_TIMEOUT = 0.5


async def _ok(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"ok": True, "bytes": len(body)})


async def _slow(request: Request) -> JSONResponse:
    await asyncio.sleep(3 * READ_TIMEOUT)
    return JSONResponse({"ok": True})


APP = Starlette(routes=[Route("/ok", _ok, methods=["GET", "POST"]), Route("/slow", _slow)])


@pytest.fixture
def port_of() -> Iterator:
    started: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(*, max_connections: int = 100, idle: float = 5.0) -> int:
        sock = bind_socket("127.0.0.1", 0)
        config = uvicorn.Config(APP, http=deadline_protocol(READ_TIMEOUT, max_connections), timeout_keep_alive=idle,
                                log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        started.append((server, thread))
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
        return sock.getsockname()[1]

    yield start
    for server, thread in started:
        server.should_exit = True
        thread.join(timeout=10)


def _answers(sock: socket.socket, count: int, seconds: float = 5.0) -> list[tuple[int, bytes]]:
    """Read `count` HTTP answers (status, body) from `sock` (Content-Length bodies)."""
    sock.settimeout(seconds)
    data, out = b"", []
    while len(out) < count:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"closed after {len(out)} answers"
            data += chunk
        head, _, data = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        while len(data) < length:
            data += sock.recv(65536)
        out.append((int(head.split()[1]), data[:length]))
        data = data[length:]
    return out


def _closed(sock: socket.socket, seconds: float) -> bytes | None:
    sock.settimeout(seconds)
    said = b""
    try:
        while chunk := sock.recv(65536):
            said += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return said


def test_a_stalled_request_is_answered_408_and_closed(port_of) -> None:
    port = port_of()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n12345")
        said = _closed(s, READ_TIMEOUT + 2)
    assert said is not None and said.startswith(b"HTTP/1.1 408")
    assert "body" in json.loads(said.partition(b"\r\n\r\n")[2])["error"]["message"]
    with socket.create_connection(("127.0.0.1", port)) as s:  # half the headers
        s.sendall(b"GET /ok HTTP/1.1\r\nHo")
        said = _closed(s, READ_TIMEOUT + 2)
    assert said is not None and said.startswith(b"HTTP/1.1 408")


def test_a_busy_keep_alive_connection_is_served_past_the_deadline(port_of) -> None:
    port = port_of()
    with socket.create_connection(("127.0.0.1", port)) as s:
        start = time.monotonic()
        while time.monotonic() - start < 4 * READ_TIMEOUT:  # each request well within its deadline
            s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _answers(s, 1)[0][0] == 200
            time.sleep(READ_TIMEOUT / 3)


def test_pipelined_requests_and_slow_answers_are_served(port_of) -> None:
    port = port_of()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
                  b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = _answers(s, 3, seconds=10)
    assert [status for status, _ in answers] == [200, 200, 200]
    assert json.loads(answers[0][1])["bytes"] == 3


def test_connections_past_the_cap_get_503_and_are_closed(port_of) -> None:
    port = port_of(max_connections=3)
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    try:
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port)) as extra:
            said = _closed(extra, 2)
        assert said is not None and said.startswith(b"HTTP/1.1 503")
        assert "--max-connections" in json.loads(said.partition(b"\r\n\r\n")[2])["error"]["message"]
    finally:
        for s in held:
            s.close()
    time.sleep(0.1)
    with socket.create_connection(("127.0.0.1", port)) as s:  # freed: served again
        s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answers(s, 1)[0][0] == 200


def test_bytes_that_are_not_http_get_a_json_400(port_of) -> None:
    port = port_of()
    for junk in (b"NOT HTTP AT ALL\r\n\r\n", b"GET /ok HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port)) as s:
            try:
                s.sendall(junk)
            except (BrokenPipeError, ConnectionResetError):
                pass
            said = _closed(s, 5)
        assert said is not None and said.startswith(b"HTTP/1.1 400")
        assert "not valid HTTP" in json.loads(said.partition(b"\r\n\r\n")[2])["error"]["message"]


def test_bind_socket_refuses_a_port_in_use_and_a_bad_host() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(QkvError, match=f"port {port} on 127.0.0.1 is in use.*--port"):
            bind_socket("127.0.0.1", port)
    with pytest.raises(QkvError, match="--host"):
        bind_socket("no-such-host.invalid", 8000)
