"""The official `openai` client, unchanged, against the real server."""

from __future__ import annotations

import openai
import pytest

from .conftest import API_KEY


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_models_chat_and_completions(client, server) -> None:
    name = server.served.name
    assert [m.id for m in client.models.list()] == [name]
    messages = [{"role": "user", "content": "What is attention?"}]
    whole = client.chat.completions.create(model=name, messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.usage.completion_tokens <= 10
    chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    completion = client.completions.create(model=name, prompt="The cat", max_tokens=5, temperature=0)
    assert completion.usage.completion_tokens == 5 or completion.choices[0].finish_reason == "stop"


def test_errors_raise_the_clients_exceptions(client, server) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=server.served.name, prompt="cat " * 300, max_tokens=4)
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
