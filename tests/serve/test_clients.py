"""Clients nobody here wrote (the `openai` SDK, litellm, langchain-openai), unchanged,
against a real `qkv serve` process on a loopback port: logprobs (compared with the model's
own log-softmax, computed here from the same checkpoint), content parts, echo with no new
tokens, and refusals naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qkv.chat.conversation import load_chat_model

from tests.serve_process import serve_process

from .conftest import API_KEY

pytestmark = pytest.mark.slow  # a server process, a second copy of the model, and litellm's import (~20 s)


@pytest.fixture(scope="module")
def served_url(tiny_folder: Path):
    with serve_process(tiny_folder, "--max-batch", "4", "--threads", "1", "--api-key", API_KEY, "--max-tokens", "64",
                       "--dtype", "float32") as server:
        yield server.url


@pytest.fixture(scope="module")
def reference(tiny_folder: Path):
    """The same checkpoint, loaded here: greedy tokens with the log-softmax each came from."""
    chat = load_chat_model(str(tiny_folder))
    model, tokenizer = chat.model.eval(), chat.tokenizer

    def greedy(messages: list[dict], n: int) -> list[tuple[str, float, list[float]]]:
        ids = tokenizer.encode(chat.template.render(messages), add_special_tokens=False).ids
        out = []
        for _ in range(n):
            with torch.inference_mode():
                logprobs = torch.log_softmax(model(torch.tensor([ids]))[0, -1].float(), dim=-1)
            allowed = logprobs.clone()
            allowed[list(chat.stop_ids)] = -torch.inf  # the requests bias the end token by -100
            token = int(allowed.argmax())
            out.append((tokenizer.decode([token]), float(logprobs[token]), logprobs.topk(2).values.tolist()))
            ids.append(token)
        return out

    def prompt_logprobs(text: str) -> list[float]:
        ids = tokenizer.encode(text).ids
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)
        return logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()

    no_end = {str(token): -100 for token in chat.stop_ids}
    return greedy, prompt_logprobs, tiny_folder.name, no_end


MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "The cat"}, {"type": "text", "text": "sat"}]}]
JOINED = [{"role": "user", "content": "The cat\nsat"}]


def _check(entries: list[tuple[str, float, list[float]]], expected: list[tuple[str, float, list[float]]]) -> None:
    assert len(entries) == len(expected) >= 1
    for (token, logprob, top), (want_token, want_logprob, want_top) in zip(entries, expected):
        assert token == want_token
        assert logprob == pytest.approx(want_logprob, abs=1e-4)
        assert top == pytest.approx(want_top, abs=1e-4)


def test_openai_sdk(served_url, reference) -> None:
    import openai

    greedy, prompt_logprobs, name, no_end = reference
    client = openai.OpenAI(base_url=served_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    reply = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2, logit_bias=no_end)
    content = reply.choices[0].logprobs.content
    _check([(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in content], greedy(JOINED, 6))
    assert reply.choices[0].message.content == "".join(e.token for e in content)
    scored = client.completions.create(model=name, prompt="The cat sat on the mat.", max_tokens=0, echo=True,
                                       logprobs=0)
    assert scored.choices[0].logprobs.token_logprobs[0] is None
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        prompt_logprobs("The cat sat on the mat."), abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=name, prompt="The cat", suffix="mat", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        client.completions.create(model=name, prompt="The cat", max_tokens=2, extra_body={"frobnicate": 1})
    listed = client.completions.create(model=name, prompt=["The cat", "Keys"], max_tokens=3, n=2, seed=7,
                                       temperature=1.0, logit_bias={"50": 100})
    assert [c.index for c in listed.choices] == [0, 1, 2, 3]
    forced = client.completions.create(model=name, prompt="Keys", max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={"50": 100}).choices[0].logprobs.tokens
    assert all(c.logprobs is None and c.text == forced[0] * 3 for c in listed.choices)


def test_litellm(served_url, reference, monkeypatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list
    litellm = pytest.importorskip("litellm")
    greedy, _, name, no_end = reference
    reply = litellm.completion(model=f"openai/{name}", api_base=served_url + "/v1", api_key=API_KEY,
                               messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                               logit_bias=no_end)
    content = reply.choices[0].logprobs.content
    _check([(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in content], greedy(JOINED, 6))


def test_langchain_openai(served_url, reference) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage

    greedy, _, name, no_end = reference
    chat = langchain_openai.ChatOpenAI(model=name, base_url=served_url + "/v1", api_key=API_KEY, temperature=0,
                                       max_tokens=6, max_retries=0, logprobs=True, top_logprobs=2,
                                       logit_bias=no_end)
    reply = chat.invoke([HumanMessage(content=MESSAGES[0]["content"])])
    content = reply.response_metadata["logprobs"]["content"]
    _check([(e["token"], e["logprob"], [t["logprob"] for t in e["top_logprobs"]]) for e in content],
           greedy(JOINED, 6))
    streamed = "".join(chunk.content for chunk in chat.stream([HumanMessage(content=MESSAGES[0]["content"])]))
    assert streamed == reply.content
