"""Every request field honoured or refused by name, against the real server on a loopback
port; logprobs, echo, bias and penalties compared with the model's own logits computed
directly (uncached, outside the engine's slots)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from .conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": server.served.name, **body}, headers=AUTH, timeout=60, **kw)


def _ok(server, path: str, body: dict) -> dict:
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def model_logprobs(server, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position of `ids`: (T, V), computed by a
    plain forward pass with no cache."""
    served = server.served

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(served.model(torch.tensor([ids]))[0].float(), dim=-1)

    return served.engine.call(run).result(60)


def ids_of(server, text: str) -> list[int]:
    return server.served.tokenizer.encode(text).ids


@pytest.mark.parametrize(("path", "field", "value"), [
    ("/v1/completions", "frobnicate", 1),
    ("/v1/completions", "suffix", "the end"),
    ("/v1/completions", "top_logprobs", 2),  # a chat field
    ("/v1/chat/completions", "echo", True),  # a completions field
    ("/v1/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),  # a chat field
    ("/v1/chat/completions", "functions", [{"name": "f"}]),  # deprecated by OpenAI: tools
    ("/v1/chat/completions", "store", True),
    ("/v1/chat/completions", "metadata", {"a": "b"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "stream_options", {"include_usage": True}),  # without stream, as OpenAI refuses
])
def test_fields_not_honoured_are_refused_by_name(server, path, field, value) -> None:
    body = {"prompt": "The cat"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = _post(server, path, {**body, field: value, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_nulls_and_defaults_of_refused_fields_pass(server) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "store": False, "suffix": None,
            "modalities": ["text"], "response_format": {"type": "text"}, "tools": None, "user": "someone"}
    assert _post(server, "/v1/chat/completions", body).status_code == 200


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "wizard", "content": "hi"}, "messages[0].role"),
    ({"role": "function", "content": "hi", "name": "f"}, "messages[0].role"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages[0].content[0].type"),
    ({"role": "user", "content": "hi", "audio": {"id": "a"}}, "messages[0].audio"),
    ({"role": "tool", "content": "42"}, "messages[0].tool_call_id"),
])
def test_bad_messages_are_refused_by_name(server, message, param) -> None:
    r = _post(server, "/v1/chat/completions", {"messages": [message], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_content_parts_are_joined_text(server) -> None:
    parts = [{"type": "text", "text": "The cat"}, {"type": "text", "text": "sat"}]
    one = _ok(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}],
                                               "max_tokens": 8, "temperature": 0})
    joined = _ok(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "The cat\nsat"}],
                                                  "max_tokens": 8, "temperature": 0})
    assert one["choices"][0]["message"] == joined["choices"][0]["message"]
    assert one["usage"] == joined["usage"]


def test_tool_messages_reach_the_template(server) -> None:
    messages = [{"role": "user", "content": "What is 6 x 7?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "mul", "arguments": '{"a": 6, "b": 7}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    answer = _ok(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    from qkv.serve.api.tools import render_messages, template_format

    template = server.served.template  # it knows no tool format: calls are written as JSON (qkv.serve.api.tools)
    shown, _ = render_messages(messages, None, template_format(template.source))
    rendered = template.render(shown)
    assert '{"name": "mul", "arguments": {"a": 6, "b": 7}}' in rendered
    assert "<|tool|>42" in rendered
    assert answer["usage"]["prompt_tokens"] == len(server.served.tokenizer.encode(rendered, add_special_tokens=False).ids)


def greedy_reference(server, prompt: list[int], n: int, *, presence: float = 0.0,
                     frequency: float = 0.0) -> list[tuple[int, torch.Tensor]]:
    """Greedy tokens, each with the model's log-softmax (V,) it was chosen from: the whole
    sequence run again at every step, OpenAI's penalties applied to the logits."""
    ids, counts, out = list(prompt), torch.zeros(server.served.model.cfg.vocab_size), []
    for _ in range(n):
        logprobs = model_logprobs(server, ids)[-1]  # log_softmax only shifts: the argmax is the logits'
        token = int((logprobs - counts * frequency - (counts > 0).float() * presence).argmax())
        if token in server.served.stop_ids:
            break
        out.append((token, logprobs))
        counts[token] += 1
        ids.append(token)
    return out


def test_completion_logprobs_are_the_models_log_softmax(server) -> None:
    prompt = ids_of(server, "The cat sat")
    answer = _ok(server, "/v1/completions", {"prompt": "The cat sat", "max_tokens": 6, "temperature": 0,
                                             "logprobs": 3})
    lp = answer["choices"][0]["logprobs"]
    reference = greedy_reference(server, prompt, 6)
    decode = server.served.tokenizer.decode
    assert lp["tokens"] == [decode([token]) for token, _ in reference] and len(reference) == 6
    for i, (token, logprobs) in enumerate(reference):
        assert lp["token_logprobs"][i] == pytest.approx(logprobs[token].item(), abs=1e-4)
        best = logprobs.topk(3)
        expected: dict[str, float] = {}
        for t, v in zip(best.indices.tolist(), best.values.tolist()):
            expected[decode([t])] = max(v, expected.get(decode([t]), -1e9))
        assert lp["top_logprobs"][i].keys() == expected.keys()
        for key, value in expected.items():
            assert lp["top_logprobs"][i][key] == pytest.approx(value, abs=1e-4)
    text = "The cat sat" + answer["choices"][0]["text"]  # offsets count from the prompt's start, as OpenAI's
    offsets = lp["text_offset"] + [len(text)]
    assert offsets == sorted(offsets) and offsets[0] == len("The cat sat")
    assert all(text[o:].startswith(token) for o, token in zip(offsets, lp["tokens"]))


def test_echo_with_no_new_tokens_scores_each_prompt_of_a_list(server) -> None:
    """lm-evaluation-harness's loglikelihood request: token-id prompts, echo, max_tokens 0."""
    prompts = [ids_of(server, "The cat sat on the mat."), ids_of(server, "Keys, queries")]
    answer = _ok(server, "/v1/completions", {"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1,
                                             "temperature": 0})
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    for ids, choice in zip(prompts, answer["choices"]):
        lp = choice["logprobs"]
        assert choice["text"] == server.served.tokenizer.decode(ids) and len(lp["tokens"]) == len(ids)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        reference = model_logprobs(server, ids)
        expected = reference[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), expected, atol=1e-4, rtol=0)
    assert answer["usage"] == {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": 0,
                               "total_tokens": sum(map(len, prompts))}


def test_chat_logprobs_streamed_equal_whole(server) -> None:
    no_end = {str(token): -100 for token in server.served.stop_ids}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "logit_bias": no_end}
    whole = _ok(server, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    streamed = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": server.served.name, **body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                streamed += (choice["logprobs"] or {}).get("content") or []
    # The second request reuses the first one's prompt keys and values (qkv.serve.engine.prefix_cache):
    # its first logits come from a one-token prefill over them, the same math in another order,
    # so the logprobs agree to float32 rounding and the tokens exactly.
    assert [e["token"] for e in streamed] == [e["token"] for e in whole] and len(whole) >= 1
    for got, want in zip(streamed, whole):
        assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-5)
        assert [t["token"] for t in got["top_logprobs"]] == [t["token"] for t in want["top_logprobs"]]
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6 for e in whole)


def test_logit_bias_forces_and_forbids(server) -> None:
    body = {"prompt": "The cat", "max_tokens": 4, "temperature": 0}
    greedy = [t for t, _ in greedy_reference(server, ids_of(server, "The cat"), 4)]
    decode = server.served.tokenizer.decode
    forbidden = _ok(server, "/v1/completions", {**body, "logprobs": 0, "logit_bias": {str(greedy[0]): -100}})
    tokens = forbidden["choices"][0]["logprobs"]["tokens"]
    assert tokens[0] != decode([greedy[0]]) and decode([greedy[0]]) not in tokens
    cat = ids_of(server, "The cat")[-1]
    forced = _ok(server, "/v1/completions", {**body, "temperature": 1.0, "seed": 5, "logit_bias": {str(cat): 100}})
    assert forced["choices"][0]["text"] == decode([cat]) * 4


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 2.0), (-1.0, 0.5)])
def test_penalties_follow_openais_formula(server, presence, frequency) -> None:
    answer = _ok(server, "/v1/completions", {"prompt": "The cat", "max_tokens": 12, "temperature": 0, "logprobs": 0,
                                             "presence_penalty": presence, "frequency_penalty": frequency})
    reference = greedy_reference(server, ids_of(server, "The cat"), 12, presence=presence, frequency=frequency)
    plain = greedy_reference(server, ids_of(server, "The cat"), 12)
    assert [t for t, _ in reference] != [t for t, _ in plain]  # the penalties change the answer
    got = answer["choices"][0]["logprobs"]
    assert got["tokens"] == [server.served.tokenizer.decode([t]) for t, _ in reference]
    # logprobs stay the model's own, before the penalties
    assert got["token_logprobs"] == pytest.approx([lp[t].item() for t, lp in reference], abs=1e-4)


def test_n_answers_share_one_prefill_and_equal_separate_seeds(server) -> None:
    body = {"prompt": "Attention is all you need", "max_tokens": 8, "temperature": 1.0}
    before = _metric(server, "qkv_prompt_tokens_total")
    together = _ok(server, "/v1/completions", {**body, "n": 3, "seed": 11})
    prefilled = _metric(server, "qkv_prompt_tokens_total") - before
    assert prefilled == len(ids_of(server, body["prompt"]))  # one prefill for three answers
    alone = [_ok(server, "/v1/completions", {**body, "seed": 11 + j})["choices"][0]["text"] for j in range(3)]
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    assert [c["text"] for c in together["choices"]] == alone


def test_more_answers_than_slots_still_equal_separate_seeds(server) -> None:
    """n=6 on 4 slots: the last two wait, then copy the prompt from a row still holding it
    or prefill it again; either way each answer is the one its seed gives alone."""
    body = {"prompt": "Keys, queries and values", "max_tokens": 6, "temperature": 1.0}
    together = _ok(server, "/v1/completions", {**body, "n": 6, "seed": 40})
    alone = [_ok(server, "/v1/completions", {**body, "seed": 40 + j})["choices"][0]["text"] for j in range(6)]
    assert [c["text"] for c in together["choices"]] == alone


def test_best_of_returns_the_candidate_of_highest_mean_logprob(server) -> None:
    body = {"prompt": "Keys", "max_tokens": 6, "temperature": 1.0, "seed": 3}
    candidates = _ok(server, "/v1/completions", {**body, "n": 4, "logprobs": 0})["choices"]
    means = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"]) for c in candidates]
    best = _ok(server, "/v1/completions", {**body, "best_of": 4})
    assert len(best["choices"]) == 1 and best["choices"][0]["text"] == candidates[means.index(max(means))]["text"]
    assert _post(server, "/v1/completions", {**body, "best_of": 4, "stream": True}).status_code == 400


def test_a_list_of_prompts_equals_each_alone(server) -> None:
    prompts = ["The cat", "Keys, queries", "A"]
    together = _ok(server, "/v1/completions", {"prompt": prompts, "max_tokens": 5, "temperature": 0, "n": 2})
    assert [c["index"] for c in together["choices"]] == list(range(6))
    for p, prompt in enumerate(prompts):
        alone = _ok(server, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0})
        assert [c["text"] for c in together["choices"][2 * p: 2 * p + 2]] == [alone["choices"][0]["text"]] * 2


def test_an_abandoned_whole_request_frees_its_slot(start_server) -> None:
    """A client that gives up on a non-streamed answer: the server notices while it waits,
    cancels the job, and the slot is free long before max_tokens would have been reached."""
    from qkv.serve.api.schemas import Limits

    slow = start_server(max_batch=2, api_key=None, limits=Limits(max_tokens=200))
    stop = threading.Event()

    def slow_steps() -> None:  # 50 ms between engine steps: 200 tokens would take 10 s
        while not stop.is_set():
            slow.served.engine.call(lambda: time.sleep(0.05)).result(30)

    slower = threading.Thread(target=slow_steps, daemon=True)
    slower.start()
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(slow.url + "/v1/completions", timeout=1.0, json={
                "model": slow.served.name, "prompt": "The cat", "max_tokens": 200, "temperature": 0.0,
                "logit_bias": {str(e): -100 for e in slow.served.stop_ids}})
        deadline = time.monotonic() + 3
        while _metric(slow, "qkv_batch_occupancy") != 0:
            assert time.monotonic() < deadline, "the abandoned request kept its slot"
            time.sleep(0.05)
        assert _metric(slow, "qkv_completion_tokens_total") < 100
    finally:
        stop.set()
        slower.join(10)


def test_tokenizer_endpoints_are_the_servers_tokenizer(server) -> None:
    """vLLM's /tokenize, /detokenize and /tokenizer_info (lm-eval's tokenizer_backend=remote)."""
    text = "The cat sat on the mat.<|end|>"
    tokenized = httpx.post(server.url + "/tokenize", headers=AUTH, json={"prompt": text, "add_special_tokens": False})
    ids = server.served.tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenized.json()["tokens"] == ids and tokenized.json()["count"] == len(ids)
    back = httpx.post(server.url + "/detokenize", headers=AUTH, json={"tokens": ids}).json()["prompt"]
    assert back == server.served.tokenizer.decode(ids, skip_special_tokens=False) == text
    info = httpx.get(server.url + "/tokenizer_info", headers=AUTH).json()
    assert info["eos_token"] == "<|end|>" and info["chat_template"] == server.served.template.source
    refused = httpx.post(server.url + "/tokenize", headers=AUTH, json={"prompt": "x", "messages": []})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
    assert httpx.post(server.url + "/detokenize", headers=AUTH, json={"tokens": [10**6]}).status_code == 400
    assert httpx.get(server.url + "/tokenizer_info").status_code == 401  # the API key guards it too


def test_a_prompt_the_tokenizer_bounds_refuse_is_a_400(server) -> None:
    """A prompt that the tokenizer's normalizer would grow past the encode bound
    (qkv.models.hf.tokenizer_guard) is the client's 400, and the server goes on answering."""
    from tokenizers import Tokenizer, normalizers

    from qkv.models.hf.tokenizer_guard import guard

    original = server.served.tokenizer
    growing = Tokenizer.from_str(original.inner.to_str())
    growing.normalizer = normalizers.Replace("o", "o" * 40)  # 40x: under the load-time bound
    server.served.tokenizer = guard(growing, "a tokenizer that grows o forty times")
    try:
        r = _post(server, "/v1/completions", {"prompt": "o" * 60_000, "max_tokens": 1})
    finally:
        server.served.tokenizer = original
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "grow" in r.json()["error"]["message"]
    assert _post(server, "/v1/completions", {"prompt": "The cat", "max_tokens": 1}).status_code == 200
