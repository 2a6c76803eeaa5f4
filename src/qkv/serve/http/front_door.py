"""The server's front door: what a request must be before any route sees it.

    app = front_door(starlette_app, Door(host="127.0.0.1"), metrics)   # an ASGI app

A loopback server is reachable from every web page the user opens. Three checks stop a page
from using it:
- `Host` must name this server (127.0.0.1, localhost, [::1], the bound `--host`, or an
  `--allowed-host`); a DNS-rebinding page reaches 127.0.0.1 under its own name, so its Host
  is refused (400). The port is not compared: rebinding is about names, and an SSH tunnel
  or a proxy may forward another port. A server bound to every interface (0.0.0.0, ::) also
  takes IP literals, which no rebinding can produce.
- A request carrying an `Origin` (browsers send one from other pages) is served only when
  it is this server's own origin or an `--cors-origin`; CORS headers are sent, and
  preflights answered, only for those (403 otherwise). CORS is off unless asked.
- A POST body is read only when sent as `Content-Type: application/json` (UTF-8): the
  types a page may send without a preflight (text/plain, forms) get 415.
Every answer, refusals included, is counted on /metrics under its route's fixed label, and an
error no route caught (even a BaseException such as a Rust panic) is a JSON 500, not plain text.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from qkv.serve.http.metrics import Metrics
from qkv.serve.api.schemas import ApiError

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
BODY_METHODS = ("POST", "PUT", "PATCH")


@dataclass(frozen=True)
class Door:
    """The front door's settings (the `qkv serve` flags of the same names)."""

    host: str = "127.0.0.1"  # the bound address
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    read_timeout: float = 10.0  # seconds for a request's headers, and then for its body
    idle_timeout: float = 5.0  # seconds a keep-alive connection may sit idle
    max_connections: int = 256  # open connections; one more is answered 503 and closed
    prompt_timeout: float = 30.0  # seconds to render a chat template and tokenize a prompt

    def host_names(self) -> frozenset[str]:
        names = set(LOOPBACK_NAMES) | {normal_host(name) for name in self.allowed_hosts}
        if self.host not in WILDCARD_HOSTS:
            names.add(normal_host(self.host))
        return frozenset(names)


def normal_host(name: str) -> str:
    """A host name as Host headers write it: lower case, IPv6 literals in brackets."""
    name = name.strip().lower()
    if ":" in name and not name.startswith("["):
        return f"[{name}]"
    return name


def host_part(header: str) -> str | None:
    """The name in a Host header value (`name`, `name:port`, `[v6]:port`); None if malformed."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        name, rest = header[: end + 1], header[end + 1:]
        if end < 0 or (rest and not (rest[0] == ":" and rest[1:].isdigit())):
            return None
        return name
    name, colon, port = header.partition(":")
    if not name or (colon and not port.isdigit()):
        return None
    return name


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


async def _answer(send: Send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class FrontDoor:
    """Outermost ASGI layer: counts every answer; checks Host and Origin (module docstring)."""

    def __init__(self, app: App, door: Door, metrics: Metrics) -> None:
        self.app, self.door, self.metrics = app, door, metrics
        self.names = door.host_names()
        self.any_ip = door.host in WILDCARD_HOSTS
        self.origins = frozenset(origin.rstrip("/") for origin in door.cors_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")

        async def counted(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count(path, message["status"])
            await send(message)

        refusal = self.refusal(scope)
        if refusal is not None:
            await _answer(counted, refusal)
            return
        started = False

        async def tracked(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await counted(message)

        try:
            await self.app(scope, receive, tracked)
        except BaseException as error:  # a Rust panic is a BaseException: still a JSON answer
            if isinstance(error, (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit)) or started:
                raise
            await _answer(counted, ApiError(500, f"internal error: {type(error).__name__}: {error}"))

    def refusal(self, scope: Scope) -> ApiError | None:
        host = _header(scope, b"host")
        if host is None:
            return ApiError(400, "the request has no Host header; send 'Host: 127.0.0.1:PORT'", code="invalid_host")
        name = host_part(host)
        if name is None or not (name in self.names or (self.any_ip and _is_ip_literal(name))):
            return ApiError(400, f"the Host header {host[:100]!r} does not name this server; a server reached under "
                            "another name needs 'qkv serve --allowed-host NAME'", code="invalid_host")
        origin = _header(scope, b"origin")
        if origin is not None and not self._origin_allowed(origin, host):
            return ApiError(403, f"requests from the web page at {origin[:100]!r} are refused; allow that page with "
                            f"'qkv serve --cors-origin {origin[:100]}'", code="origin_not_allowed")
        return None

    def _origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.strip().rstrip("/")
        if origin in self.origins or "*" in self.origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.netloc.lower() == host.strip().lower()


class JsonOnly:
    """Inner ASGI layer: a body-carrying request must be JSON in UTF-8, else 415."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") in BODY_METHODS:
            given = _header(scope, b"content-type")
            problem = json_type_problem(given)
            if problem:
                await _answer(send, ApiError(415, problem, code="unsupported_media_type"))
                return
        await self.app(scope, receive, send)


def json_type_problem(content_type: str | None) -> str | None:
    """Why `content_type` is not JSON in UTF-8 (None when it is)."""
    if content_type is None:
        return "the request has no Content-Type; send the JSON body with 'Content-Type: application/json'"
    media, *params = (part.strip().lower() for part in content_type.split(";"))
    if media != "application/json":
        return (f"the body is sent as {media or 'an empty type'!r}; this server reads only JSON: "
                "send 'Content-Type: application/json'")
    for param in params:
        key, _, value = param.partition("=")
        if key.strip() == "charset" and value.strip().strip('"') not in ("utf-8", "utf8"):
            return f"the body's charset is {value.strip()!r}; send JSON in UTF-8"
    return None


def front_door(app: App, door: Door, metrics: Metrics) -> App:
    """`app` behind the front door: Host and Origin checks, CORS when asked, JSON bodies only."""
    inner: App = JsonOnly(app)
    if door.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        origins = [origin.rstrip("/") for origin in door.cors_origins]
        inner = CORSMiddleware(inner, allow_origins=origins, allow_methods=["GET", "POST"],
                               allow_headers=["authorization", "content-type"], max_age=600)
    return FrontDoor(inner, door, metrics)
