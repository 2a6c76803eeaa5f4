"""Hostile and runaway structured output against the real server (in-process on a loopback
port, and once as a `qkv serve` subprocess): $ref chains and nesting of 3,000 and 30,000 and
$ref loops are a 400 naming the problem, never a crash or a 500; an integer field the model
would fill with digits forever stops at the bound; a forced tool call cut off by max_tokens
is still a tool call, with finish_reason "length"."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from qkv.generation.schema_limits import MAX_INTEGER_DIGITS
from qkv.serve.api.schemas import Limits
from tests.generation.test_schema_limits import LOOPS, TREE, ref_chain
from tests.serve_process import serve_process

from ..conftest import API_KEY
from .structured_server import tiny_long_context_folder

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "The biggest city?"}]
CITY = {"type": "object", "properties": {"name": {"enum": ["Paris"]}, "population": {"type": "integer"}},
        "required": ["name", "population"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A context of 1,024 tokens: room for a tool list in the prompt."""
    return tiny_long_context_folder(tmp_path_factory.mktemp("models") / "tiny-long")


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(limits=Limits(max_tokens=64, max_body_bytes=4 << 20))  # room for a 30,000-long chain


def _chat(url: str, body: dict | str, headers: dict = AUTH) -> httpx.Response:
    """POST a chat request with `body`'s fields (a str: the raw JSON of the fields, for
    nesting deeper than the client's json module writes)."""
    model = httpx.get(url + "/health", timeout=10).json()["model"]
    head = {"model": model, "messages": MESSAGES, "max_tokens": 8}
    if isinstance(body, str):
        return httpx.post(url + "/v1/chat/completions", headers={**headers, "Content-Type": "application/json"},
                          timeout=120, content=json.dumps(head)[:-1] + ", " + body[1:])
    return httpx.post(url + "/v1/chat/completions", headers=headers, timeout=120, json={**head, **body})


def _schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _tool_format(schema: dict) -> dict:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    return {"tools": [tool], "tool_choice": "required"}


def _refused(url: str, body: dict | str, message: str, param: str | None) -> None:
    reply = _chat(url, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["param"] == param, error
    assert "<state>" not in error["message"] and "Parser" not in error["message"]  # no library internals
    assert httpx.get(url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("n", [3_000, 30_000])
@pytest.mark.parametrize(("field", "param"), [(_schema_format, "response_format"), (_tool_format, "tools")])
def test_long_ref_chains_are_a_400(server, n: int, field, param: str) -> None:
    _refused(server.url, field(ref_chain(n)), "too deep", param)


@pytest.mark.parametrize("n", [3_000, 30_000])
def test_deep_nesting_is_a_400(server, n: int) -> None:
    schema = '{"type": "array", "items": ' * n + '{"type": "integer"}' + "}" * n
    body = '{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}}' % schema
    _refused(server.url, body, "nested deeper", None)


@pytest.mark.parametrize("name", list(LOOPS))
def test_loops_with_no_document_are_a_400(server, name: str) -> None:
    _refused(server.url, _schema_format(LOOPS[name]), "recursive with no finite document", "response_format")


def test_a_recursive_schema_with_a_way_out_is_served(server) -> None:
    reply = _chat(server.url, {**_schema_format(TREE), "max_tokens": 64})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"].startswith('{"value": ')


def _digit_bias(server, digit: str = "1") -> dict:
    return {"logit_bias": {str(server.served.tokenizer.token_to_id(digit)): 100}}


def test_an_integer_the_model_would_repeat_forever_stops_at_the_bound(server) -> None:
    """The bias makes "1" the model's choice at every step: without a bound the integer runs
    to max_tokens ("length", not JSON); with it the grammar ends the number after 16 digits."""
    reply = _chat(server.url, {**_schema_format(CITY), "max_tokens": 64, **_digit_bias(server)})
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    document = json.loads(choice["message"]["content"])
    assert document == {"name": "Paris", "population": int("1" * MAX_INTEGER_DIGITS)}


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_off_is_a_tool_call_with_finish_length(server, stream: bool) -> None:
    body = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 64, "stream": stream,
            **_digit_bias(server, "a")}  # "aaaa..." in the city: longer than 64 tokens
    reply = _chat(server.url, body)
    assert reply.status_code == 200, reply.text
    if not stream:
        choice = reply.json()["choices"][0]
        calls, finish = choice["message"]["tool_calls"], choice["finish_reason"]
        assert choice["message"]["content"] is None
    else:
        chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        finish = next(d["finish_reason"] for d in deltas if d["finish_reason"])
        parts = [call for d in deltas for call in d["delta"].get("tool_calls") or []]
        calls = [{"function": {"name": parts[0]["function"]["name"],
                               "arguments": "".join(p["function"]["arguments"] for p in parts)}}]
    assert finish == "length"
    (call,) = calls
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"].startswith('{"city": "a')  # the arguments so far, unfinished


def test_a_3000_chain_leaves_a_server_process_running(tiny_folder: Path, tmp_path: Path) -> None:
    """As a user runs it: the hostile request answered 400 while /health keeps answering
    (polled throughout, from another thread), and the process alive after it."""
    with serve_process(tiny_folder, "--threads", "1", log=tmp_path / "serve.log") as process:
        health: list[int] = []
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                try:
                    health.append(httpx.get(process.url + "/health", timeout=10).status_code)
                except httpx.TransportError:
                    health.append(0)
                time.sleep(0.05)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            reply = _chat(process.url, _schema_format(ref_chain(3_000)), headers={})
        finally:
            time.sleep(0.2)
            done.set()
            poller.join(timeout=30)
        assert reply.status_code == 400 and "too deep" in reply.json()["error"]["message"], reply.text
        assert health and set(health) == {200}, health
        assert httpx.get(process.url + "/health", timeout=10).status_code == 200
        assert process.process.poll() is None
