"""Connections under bounds: the listening socket bound before anything is announced, read
deadlines on every connection, and a cap on how many are open.

    sock = bind_socket("127.0.0.1", 8000)          # QkvError (one line) if the port is taken
    run_uvicorn(app, sock, Door())                 # serves until SIGINT / SIGTERM

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but a connection
that sends half its headers, or one byte after each answer, or headers and then a trickle of
body, stays open for ever; enough of them hold every file descriptor. `deadline_protocol`
gives uvicorn's h11 protocol a read deadline: a request's headers must be complete within
`read_timeout` seconds of the connection opening (or of the previous answer), and then its
body within `read_timeout` more; otherwise it is answered 408 and closed. Past
`max_connections` open connections a new one is answered 503 and closed at once. Bytes that
are not HTTP get a JSON 400 (uvicorn's own is plain text).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from typing import Any

from qkv.errors import QkvError
from qkv.serve.http.front_door import Door

BACKLOG = 2048


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, or QkvError naming the problem (port in use...)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as error:
        raise QkvError(f"--host {host!r} is not an address this machine can bind: {error}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not SO_REUSEPORT: a live server keeps its port
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as error:
        sock.close()
        reason = "is in use by another program" if error.errno in (98, 48) else f"cannot be bound ({error.strerror})"
        raise QkvError(f"port {port} on {host} {reason}; choose another --port") from None
    sock.setblocking(False)
    return sock


def _raw_answer(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "api_error", "param": None, "code": None}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


def deadline_protocol(read_timeout: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the read deadline and connection cap of the module docstring."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineProtocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._deadline: asyncio.TimerHandle | None = None
            self._phase: str | None = None  # "headers" or "body" while the client owes them

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._close_with(503, "Service Unavailable", f"the server has {max_connections} connections open "
                                 "(its --max-connections); retry shortly")
                return
            self._watch()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:  # uvicorn's answer to bytes that are not HTTP
            self._close_with(400, "Bad Request", f"the request is not valid HTTP/1.1 ({msg.rstrip('.')})")

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _watch(self) -> None:
            """Arm the deadline when the client starts owing headers or a body; drop it when paid."""
            if self.transport.is_closing():
                self._disarm()
                return
            state = self.conn.their_state
            phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
            if phase != self._phase:
                self._disarm()
                self._phase = phase
                if phase is not None:
                    self._deadline = self.loop.call_later(read_timeout, self._expired)

        def _expired(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and self.cycle.response_started:
                self.transport.close()  # an answer is out or on its way: nothing else can be said
                return
            what = "headers" if self._phase == "headers" else "body"
            self._close_with(408, "Request Timeout", f"the request's {what} did not arrive within {read_timeout:g} s")

        def _close_with(self, status: int, reason: str, message: str) -> None:
            if self.cycle is not None:
                self.cycle.disconnected = True  # the app's answer, if any comes, goes nowhere
            self.transport.write(_raw_answer(status, reason, message))
            self.transport.close()

    return DeadlineProtocol


def run_uvicorn(app: Any, sock: socket.socket, door: Door, on_stop: Callable[[], None] | None = None) -> None:
    """Serve `app` on the bound `sock` until a signal stops it; QkvError if it cannot start.
    `on_stop` runs once the server has shut down, before uvicorn raises the signal again
    (a SIGTERM then ends the process at once: no line printed after `run` would show)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            try:
                await super().shutdown(sockets=sockets)
            finally:
                if on_stop is not None and self.started:
                    on_stop()

    config = uvicorn.Config(app, http=deadline_protocol(door.read_timeout, door.max_connections),
                            timeout_keep_alive=door.idle_timeout,  # type: ignore[arg-type]
                            ws="none", log_level="warning")  # no WebSocket routes: no upgrades either
    server = Server(config)
    server.run(sockets=[sock])
    if not server.started:
        raise QkvError("the server did not start (see the message above)")
