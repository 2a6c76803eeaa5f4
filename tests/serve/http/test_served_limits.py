"""What the server holds requests to and says about itself: --context enforced (below the
model's own context and below the cache's rounded-up capacity), the same limit reported by
/tokenize, /tokenizer_info and /v1/models, the precision and kernels in /v1/models, and
/tokenize counting a chat as the chat route renders it (vLLM's `messages` form)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

CONTEXT = 100  # under the tiny model's 256, and not a capacity the cache would allocate (256)


@pytest.fixture(scope="module")
def app(tiny_folder):
    from qkv.serve.http.app import build_app
    from qkv.serve.http.server import load_served

    served = load_served(str(tiny_folder), precision="int8", max_batch=1, capacity=CONTEXT)
    with TestClient(build_app(served), base_url="http://127.0.0.1") as client:
        yield client, served


def test_a_prompt_over_context_is_a_400_naming_the_limit(app) -> None:
    client, served = app
    assert served.engine.capacity > CONTEXT  # the slots' cache is larger: the limit is --context itself
    prompt = [5] * 95
    r = client.post("/v1/completions", json={"model": served.name, "prompt": prompt, "max_tokens": 10})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert f"context of {CONTEXT} tokens" in r.json()["error"]["message"]
    fits = client.post("/v1/completions", json={"model": served.name, "prompt": prompt, "max_tokens": 5})
    assert fits.status_code == 200, fits.text


def test_the_limit_precision_and_kernels_are_reported(app) -> None:
    from qkv.runtime.native import native_kernels

    client, served = app
    assert client.post("/tokenize", json={"prompt": "The cat"}).json()["max_model_len"] == CONTEXT
    assert client.get("/tokenizer_info").json()["model_max_length"] == CONTEXT
    (card,) = client.get("/v1/models").json()["data"]
    assert card["id"] == served.name and card["max_model_len"] == CONTEXT
    assert card["qkv"]["precision"] == "int8" and card["qkv"]["kernels"] == native_kernels().describe()
    assert card["qkv"]["max_model_len"] == CONTEXT and card["qkv"]["context_length"] == 256
    assert client.get(f"/v1/models/{served.name}").json() == card


def test_tokenize_counts_messages_as_the_chat_template_renders_them(app) -> None:
    client, served = app
    messages = [{"role": "user", "content": "The cat sat"}]
    for generation in (True, False):
        body = {"messages": messages} if generation else {"messages": messages, "add_generation_prompt": False}
        r = client.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        text = served.template.render(messages, add_generation_prompt=generation)
        assert r.json()["tokens"] == served.tokenizer.encode(text, add_special_tokens=False).ids
    # the count is the chat route's prompt: usage.prompt_tokens of the same messages
    usage = client.post("/v1/chat/completions", json={"model": served.name, "messages": messages,
                                                      "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == client.post("/tokenize", json={"messages": messages}).json()["count"]
    bad = client.post("/tokenize", json={"messages": [{"role": "wizard", "content": "hi"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].role"


def test_bad_types_are_400_as_openai_answers_them(app) -> None:
    """OpenAI's SDK raises BadRequestError for a 400; a 422 would be another exception."""
    openai = pytest.importorskip("openai")
    client, served = app
    sdk = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=client, max_retries=0)
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=served.name, prompt="hi", temperature="hot")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model=served.name, messages=[{"role": "user", "content": 3}])  # type: ignore[list-item]
