"""Hostile requests at a real `qkv serve` (a subprocess on a free 127.0.0.1 port, a tiny random
model): foreign Host and Origin headers, non-JSON bodies, malformed numbers and strings,
/metrics label floods, half-sent and idle connections, megabyte prompts. Each must get a clean
JSON error (never a 500 or a hang), and the server must answer /health within 1 s during and
after each. Loops are bounded; the server is always stopped."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from qkv.serve.http.metrics import MODEL_ROUTE, OTHER, ROUTES
from tests.serve_process import serve_process

pytestmark = pytest.mark.xdist_group("hostile-server")

KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
READ_TIMEOUT = 2.0
ALLOWED = "qkv.test"
PAGE = "http://page.test:3000"


@dataclass
class Server:
    url: str
    port: int
    model: str
    process: subprocess.Popen


@contextlib.contextmanager
def _serve(folder: Path, log: Path, *flags: str) -> Iterator[Server]:
    """`qkv serve` on a free port with `flags`, until /health answers; stopped afterwards."""
    with serve_process(folder, "--api-key", KEY, "--max-batch", "2", "--threads", "1", *flags, log=log,
                       start_s=60) as running:
        yield Server(running.url, running.port, folder.name, running.process)
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def server(tiny_chat_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with _serve(tiny_chat_folder, tmp_path_factory.mktemp("hostile-server") / "stderr.txt",
                "--read-timeout", str(READ_TIMEOUT), "--idle-timeout", "1", "--allowed-host", ALLOWED,
                "--cors-origin", PAGE, "--max-connections", "400") as running:
        yield running


def assert_healthy(server: Server) -> float:
    """GET /health answered 200 within 1 s; returns the seconds it took."""
    start = time.monotonic()
    r = httpx.get(server.url + "/health", timeout=1.0)
    took = time.monotonic() - start
    assert r.status_code == 200 and took < 1.0
    return took


def assert_json_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    return error


# -- Host and Origin (DNS rebinding, other pages) ------------------------------------------
@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.nip.io:{port}", "localhost.:{port}",
                                  "[::1", "127.0.0.1:{port}:1", ""])
def test_foreign_host_is_refused(server: Server, host: str) -> None:
    r = httpx.get(server.url + "/v1/models", headers={**AUTH, "Host": host.format(port=server.port)}, timeout=5)
    assert assert_json_error(r, 400)["code"] == "invalid_host"
    assert_healthy(server)


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST", "[::1]:{port}",
                                  ALLOWED, ALLOWED + ":8443"])
def test_own_names_are_served(server: Server, host: str) -> None:
    r = httpx.get(server.url + "/v1/models", headers={**AUTH, "Host": host.format(port=server.port)}, timeout=5)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == server.model


def test_request_without_host_is_refused(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        answer = _read_all(s, 5)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["code"] == "invalid_host"


def test_other_pages_are_refused_and_cors_only_for_the_allowed_origin(server: Server) -> None:
    body = {"model": server.model, "prompt": "The cat", "max_tokens": 2}
    evil = httpx.post(server.url + "/v1/completions", json=body, headers={**AUTH, "Origin": "http://evil.example"},
                      timeout=30)
    assert assert_json_error(evil, 403)["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in evil.headers
    own = httpx.post(server.url + "/v1/completions", json=body, timeout=30,
                     headers={**AUTH, "Origin": f"http://127.0.0.1:{server.port}"})
    assert own.status_code == 200 and "access-control-allow-origin" not in own.headers
    preflight = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    ok = httpx.options(server.url + "/v1/completions", headers=preflight, timeout=5)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == PAGE
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    refused = httpx.options(server.url + "/v1/completions", timeout=5,
                            headers={**preflight, "Origin": "http://evil.example"})
    assert assert_json_error(refused, 403)["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in refused.headers
    allowed = httpx.post(server.url + "/v1/completions", json=body, headers={**AUTH, "Origin": PAGE}, timeout=30)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == PAGE
    assert_healthy(server)


# -- bodies: JSON only, and parsed defensively ----------------------------------------------
@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None, "application/json; charset=latin-1",
                                          "application/jsonp", "application/x-json"])
def test_non_json_bodies_get_415(server: Server, content_type: str | None) -> None:
    headers = dict(AUTH) if content_type is None else {**AUTH, "Content-Type": content_type}
    body = json.dumps({"model": server.model, "prompt": "The cat", "max_tokens": 2}).encode()
    for path in ("/v1/completions", "/v1/chat/completions", "/explorer/trace"):
        r = httpx.post(server.url + path, content=body, headers=headers, timeout=10)
        assert assert_json_error(r, 415)["code"] == "unsupported_media_type"
    assert_healthy(server)


def test_json_with_charset_is_served(server: Server) -> None:
    body = json.dumps({"model": server.model, "prompt": "The cat", "max_tokens": 2}).encode()
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=30,
                   headers={**AUTH, "Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


MALFORMED = {
    "lone surrogate in prompt": '{"model": "M", "prompt": "ab\\ud800cd", "max_tokens": 2}',
    "lone low surrogate": '{"model": "M", "prompt": "\\udfff", "max_tokens": 2}',
    "lone surrogate in chat": '{"model": "M", "messages": [{"role": "user", "content": "x\\ud83d"}]}',
    "lone surrogate in a key": '{"model": "M", "prompt": "hi", "\\ud800": 1}',
    "lone surrogate in model": '{"model": "\\udc00", "prompt": "hi"}',
    "temperature 1e400": '{"model": "M", "prompt": "hi", "temperature": 1e400}',
    "temperature -1e400": '{"model": "M", "prompt": "hi", "temperature": -1e400}',
    "top_p 1e999": '{"model": "M", "prompt": "hi", "top_p": 1e999}',
    "NaN literal": '{"model": "M", "prompt": "hi", "temperature": NaN}',
    "Infinity literal": '{"model": "M", "prompt": "hi", "temperature": Infinity}',
    "-Infinity literal": '{"model": "M", "prompt": "hi", "top_p": -Infinity}',
    "5000-digit max_tokens": '{"model": "M", "prompt": "hi", "max_tokens": ' + "9" * 5000 + "}",
    "5000-digit seed": '{"model": "M", "prompt": "hi", "seed": -' + "1" * 5000 + "}",
    "300-digit temperature": '{"model": "M", "prompt": "hi", "temperature": 1' + "0" * 300 + "}",
    "long float text": '{"model": "M", "prompt": "hi", "temperature": 0.' + "1" * 5000 + "}",
    "nesting 100000": '{"model": "M", "prompt": "hi", "x": ' + _nested(100_000) + "}",
    "nesting 200": '{"model": "M", "prompt": "hi", "x": ' + _nested(200) + "}",
    "nested objects": '{"model": "M", "prompt": "hi", "x": ' + '{"a": ' * 500 + "1" + "}" * 500 + "}",
    "not JSON": "{model: M}",
    "empty body": "",
    "trailing garbage": '{"model": "M", "prompt": "hi"} x',
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_numbers_and_strings_are_400(server: Server, name: str) -> None:
    body = MALFORMED[name].replace('"M"', json.dumps(server.model))
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server.url + path, content=body.encode(), headers=JSON, timeout=30)
    assert_json_error(r, 400)
    assert_healthy(server)


@pytest.mark.parametrize("raw", [b'{"model": "\xff\xfe", "prompt": "hi"}', '{"prompt": "hi"}'.encode("utf-16"),
                                 b"\xef\xbb\xbf{}", b'{"prompt": "\xed\xa0\x80"}'])
def test_bodies_that_are_not_utf8_json_are_400(server: Server, raw: bytes) -> None:
    r = httpx.post(server.url + "/v1/completions", content=raw, headers=JSON, timeout=30)
    assert_json_error(r, 400)
    trace = httpx.post(server.url + "/explorer/trace", content=raw, headers=JSON, timeout=30)
    assert_json_error(trace, 400)


# -- /metrics -------------------------------------------------------------------------------
def test_metrics_labels_stay_a_fixed_set_and_parse(server: Server) -> None:
    assert assert_json_error(httpx.get(server.url + "/metrics", timeout=5), 401)["code"] == "invalid_api_key"
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=5) as client:
        before = len(client.get("/metrics").text)
        for i in range(300):
            client.get(f'/v1/models/m{i}"x\\y')
            client.get(f"/no/such/{i}%22%0a")
        page = client.get("/metrics").text
    assert len(page) < before + 2000  # no label per path: the page hardly grows
    samples = [sample for family in text_string_to_metric_families(page) for sample in family.samples
               if sample.name == "qkv_requests_total"]
    paths = {sample.labels["path"] for sample in samples}
    assert paths <= ROUTES | {MODEL_ROUTE, OTHER} and {MODEL_ROUTE, OTHER} <= paths
    counts = {(s.labels["path"], s.labels["status"]): s.value for s in samples}
    assert counts[(MODEL_ROUTE, "404")] >= 300 and counts[(OTHER, "404")] >= 300
    assert_healthy(server)


# -- connections: half-sent, trickled, idle ---------------------------------------------------
def _read_all(sock: socket.socket, seconds: float) -> bytes:
    sock.settimeout(seconds)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except TimeoutError:
        pass
    return b"".join(chunks)


def _closed_by_server(sock: socket.socket, deadline: float) -> bytes | None:
    """What the server wrote before closing `sock`, or None if it was still open at `deadline`."""
    chunks = []
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, min(0.2, deadline - time.monotonic())))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return b"".join(chunks)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
    return None


def test_150_half_sent_and_idle_connections_are_closed_and_health_answers(server: Server) -> None:
    sockets = []
    try:
        for i in range(150):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            kind = i % 3
            if kind == 1:  # half the headers
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
            elif kind == 2:  # headers, then 10 of 100 body bytes
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
                          + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
            sockets.append((kind, s))
        opened = time.monotonic()
        for _ in range(3):
            assert_healthy(server)  # during
        deadline = opened + READ_TIMEOUT + 3.0
        for kind, s in sockets:
            said = _closed_by_server(s, deadline)
            assert said is not None, f"a connection of kind {kind} was still open {READ_TIMEOUT + 3:g} s later"
            if kind == 2:
                assert said.startswith(b"HTTP/1.1 408"), said[:200]
    finally:
        for _, s in sockets:
            s.close()
    assert_healthy(server)  # after


def test_a_trickled_request_is_closed_despite_its_activity(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        start = time.monotonic()
        request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100
        closed = False
        for byte in request:  # one byte every 0.1 s: 10 s in all, if the server let it
            try:
                s.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            s.settimeout(0.1)
            try:
                said = s.recv(65536)
                if said == b"" or said.startswith(b"HTTP/1.1 408"):
                    closed = True
                    break
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
                break
        assert closed and time.monotonic() - start < READ_TIMEOUT + 2.0
    assert_healthy(server)


def test_an_idle_keep_alive_connection_is_closed(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        said = _closed_by_server(s, time.monotonic() + 1.0 + 3.0)  # --idle-timeout 1
        assert said is not None and said.startswith(b"HTTP/1.1 200")


# -- big prompts are prepared off the event loop ----------------------------------------------
@pytest.mark.slow  # tokenizing 1 MiB takes 1-5 s: long enough that the loop would have stalled
@pytest.mark.parametrize("chat", [False, True])
def test_a_megabyte_prompt_does_not_stall_health(server: Server, chat: bool) -> None:
    import concurrent.futures

    # Just under the 1 MiB body limit; a chat message under the template's 1,000,000-character output.
    text = ("The cat sat on the mat. " * 44_000)[: 900_000 if chat else (1 << 20) - 300]
    body = ({"model": server.model, "messages": [{"role": "user", "content": text}]} if chat
            else {"model": server.model, "prompt": text, "max_tokens": 2})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, server.url + path, json=body, headers=AUTH, timeout=60)
        took = []
        while not answer.done() and len(took) < 200:
            took.append(assert_healthy(server))  # during: every probe within 1 s
            time.sleep(0.05)
        r = answer.result(timeout=60)
    assert len(took) >= 2  # the prompt took long enough for /health to be probed meanwhile
    assert assert_json_error(r, 400)["code"] == "context_length_exceeded"
    assert_healthy(server)


@pytest.mark.slow  # a second server, with a short --prompt-timeout
def test_a_prompt_past_the_prompt_timeout_is_400_and_the_server_goes_on(
        tiny_chat_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    log = tmp_path_factory.mktemp("hostile-prompt-timeout") / "stderr.txt"
    with _serve(tiny_chat_folder, log, "--prompt-timeout", "0.5") as quick:
        text = ("The cat sat on the mat. " * 44_000)[: (1 << 20) - 300]  # 1-5 s to tokenize
        start = time.monotonic()
        r = httpx.post(quick.url + "/v1/completions", json={"model": quick.model, "prompt": text, "max_tokens": 2},
                       headers=AUTH, timeout=60)
        assert assert_json_error(r, 400)["code"] == "prompt_timeout" and time.monotonic() - start < 3.0
        assert_healthy(quick)  # the abandoned tokenization runs on in its thread, off the loop
        small = httpx.post(quick.url + "/v1/completions", json={"model": quick.model, "prompt": "The cat",
                                                                 "max_tokens": 2}, headers=AUTH, timeout=30)
        assert small.status_code == 200
        assert_healthy(quick)
