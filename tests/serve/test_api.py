"""The real server on a loopback port: OpenAI shapes, batching equal to qkv.generate,
streaming, errors, cancellation and metrics."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import pytest
import torch

from qkv.generation import generate

from .conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(server, path: str, body: object, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=60, **kw)


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))




def reference_text(server, prompt: str, n: int) -> str:
    served = server.served
    ids = served.tokenizer.encode(prompt).ids
    future = served.engine.call(lambda: generate(served.model, torch.tensor([ids]), n,
                                                 eos_token_id=tuple(served.stop_ids)))
    new = future.result(60)[0, len(ids):].tolist()
    return served.tokenizer.decode(new, skip_special_tokens=True)


def test_health_models_and_metrics(server) -> None:
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    models = httpx.get(server.url + "/v1/models", headers=AUTH).json()
    assert models["object"] == "list" and models["data"][0]["id"] == server.served.name
    assert httpx.get(server.url + "/metrics").status_code == 401  # behind --api-key like /v1
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    for name in ("qkv_requests_total", "qkv_batch_occupancy", "qkv_time_to_first_token_seconds_bucket",
                 "qkv_tokens_per_second", "qkv_completion_tokens_total", "qkv_prefill_chunks_total"):
        assert name in text
    for name in ("qkv_queue_seconds", "qkv_prefill_seconds", "qkv_inter_token_seconds"):
        assert f'{name}_bucket{{le="+Inf"}}' in text and f"{name}_count" in text


def test_concurrent_greedy_completions_equal_generate_alone(server) -> None:
    prompts = ["The cat", "Attention is all", "Keys, queries", "The mat.", "values", "they said", "A", "sat on"]
    counts = {name: _metric(server, name + "_count") for name in
              ("qkv_queue_seconds", "qkv_prefill_seconds", "qkv_inter_token_seconds")}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: _post(server, "/v1/completions", {
            "model": server.served.name, "prompt": p, "max_tokens": 10, "temperature": 0}).json(), prompts))
    for prompt, answer in zip(prompts, answers):
        assert answer["object"] == "text_completion"
        assert answer["choices"][0]["text"] == reference_text(server, prompt, 10)
        assert answer["usage"]["prompt_tokens"] == len(server.served.tokenizer.encode(prompt).ids)
    assert _metric(server, "qkv_batch_occupancy") == 0
    grown = {name: _metric(server, name + "_count") - n for name, n in counts.items()}
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    assert grown["qkv_queue_seconds"] == grown["qkv_prefill_seconds"] == len(prompts)
    assert grown["qkv_inter_token_seconds"] >= tokens - len(prompts)  # every token after a request's first


def test_stream_matches_whole_answer_with_usage(server) -> None:
    body = {"model": server.served.name, "messages": [{"role": "user", "content": "What is attention?"}],
            "max_tokens": 12, "temperature": 0}
    whole = _post(server, "/v1/chat/completions", body).json()
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text and text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"] == whole["usage"] and chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_streamed_completion_text_and_offsets_equal_the_whole_answer(server, seed: int) -> None:
    """Sampled tokens of a byte-level tokenizer split characters over tokens; the streamed
    pieces (qkv.generation.detokenize) join to the whole answer, which is the decoding of its
    tokens, stop strings and logprob offsets included."""
    body = {"model": server.served.name, "prompt": "The cat", "max_tokens": 24, "temperature": 1.5,
            "seed": seed, "logprobs": 1, "logit_bias": {str(t): -100 for t in server.served.stop_ids}}
    plain = _post(server, "/v1/completions", body).json()["choices"][0]
    tokens = plain["logprobs"]["tokens"]
    stop = plain["text"][5:7] if len(plain["text"]) > 8 else None
    for stops in (None, stop):
        request = {**body, "stop": stops} if stops else body
        whole = _post(server, "/v1/completions", request).json()["choices"][0]
        with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, timeout=60,
                          json={**request, "stream": True}) as r:
            chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["text"] for c in chunks) == whole["text"]
        offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        assert offsets == whole["logprobs"]["text_offset"]
        assert chunks[-1]["finish_reason"] == whole["finish_reason"]
    assert len(tokens) == 24 and any(t == "\ufffd" for t in tokens)  # some token held part of a character


def test_stop_string_cuts_the_text(server) -> None:
    full = _post(server, "/v1/completions", {"model": server.served.name, "prompt": "The cat",
                                             "max_tokens": 12, "temperature": 0}).json()["choices"][0]["text"]
    stop = full[3:5]
    cut = _post(server, "/v1/completions", {"model": server.served.name, "prompt": "The cat", "stop": stop,
                                            "max_tokens": 12, "temperature": 0}).json()["choices"][0]
    assert cut["text"] == full[: full.index(stop)] and cut["finish_reason"] == "stop"


def test_seeded_sampling_repeats(server) -> None:
    body = {"model": server.served.name, "prompt": "The", "max_tokens": 8, "temperature": 1.0, "top_p": 0.9,
            "seed": 7}
    assert _post(server, "/v1/completions", body).json()["choices"] == _post(server, "/v1/completions", body).json()["choices"]


@pytest.mark.parametrize(("body", "status"), [
    (b"{not json", 400),
    ({"model": "tiny", "prompt": 3}, 400),
    ({"model": "no-such-model", "prompt": "hi"}, 404),
    ({"prompt": "hi", "max_tokens": -1}, 400),
    ({"prompt": "cat " * 300, "max_tokens": 4}, 400),
    ({"prompt": "hi", "temperature": "hot"}, 400),
])
def test_bad_requests_get_openai_errors(server, body, status) -> None:
    if isinstance(body, dict) and "model" not in body:
        body = {"model": server.served.name, **body}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + "/v1/completions", content=content, timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert error["message"] and "Traceback" not in error["message"] and error["type"]


def test_big_body_wrong_key_and_unknown_route(server) -> None:
    r = httpx.post(server.url + "/v1/completions", content=b"x" * (10 << 20), timeout=60,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and "error" in r.json()
    r = httpx.post(server.url + "/v1/completions", json={"model": "x", "prompt": "hi"},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/nothing", headers=AUTH).status_code == 404


def test_closed_stream_frees_its_slot(server) -> None:
    body = {"model": server.served.name, "prompt": "The cat", "max_tokens": 64, "temperature": 0, "stream": True}
    for _ in range(3):
        with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
    deadline = time.monotonic() + 20
    while _metric(server, "qkv_batch_occupancy") != 0:
        assert time.monotonic() < deadline, "a closed connection kept its slot"
        time.sleep(0.05)


def test_a_full_server_answers_503_with_retry_after(start_server) -> None:
    small = start_server(max_batch=1, max_waiting=0, api_key=None)
    body = {"model": small.served.name, "prompt": "The cat", "max_tokens": 8, "temperature": 0}
    hold = threading.Event()
    blocked = small.served.engine.call(lambda: hold.wait(30))  # the engine thread waits: nothing is admitted
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, small.url + "/v1/completions", json=body, timeout=60)
            deadline = time.monotonic() + 20
            while small.served.engine.stats.waiting == 0:  # the first request takes the one slot's place
                assert time.monotonic() < deadline
                time.sleep(0.01)
            busy = httpx.post(small.url + "/v1/completions", json=body, timeout=30)
            hold.set()
            assert first.result().status_code == 200
    finally:
        hold.set()
        blocked.result(30)
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["type"] == "server_overloaded"


def test_many_clients_some_cancelled_complete_answers_and_no_slot_leaked(server) -> None:
    """40 streaming requests from 8 clients, a quarter closed after their first chunk: every
    other one gets the whole greedy answer, and no slot stays occupied afterwards."""
    prompts = [f"The cat {i}" for i in range(40)]
    body = {"model": server.served.name, "max_tokens": 16, "temperature": 0, "stream": True}

    def one(i: int) -> str | None:
        with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, timeout=60,
                          json={**body, "prompt": prompts[i]}) as r:
            text = ""
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text += json.loads(line[6:])["choices"][0]["text"]
                if i % 4 == 0:
                    return None  # close mid-stream
            return text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(40)))
    for prompt, answer in zip(prompts, answers):
        if answer is not None:
            assert answer == reference_text(server, prompt, 16)
    deadline = time.monotonic() + 20
    while _metric(server, "qkv_batch_occupancy") != 0 or _metric(server, "qkv_queue_waiting") != 0:
        assert time.monotonic() < deadline, "a slot was leaked"
        time.sleep(0.05)
