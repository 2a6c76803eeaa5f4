"""response_format and tools through the official `openai` client against a `qkv serve`
subprocess on a tiny random model: the hardest case for a grammar, since the model itself
knows nothing of JSON. Every reply must parse and validate all the same."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

from .structured_server import PERSON, WEATHER, qkv_serve, tiny_long_context_folder

MESSAGES = [{"role": "user", "content": "Tell me about someone."}]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory):
    folder = tiny_long_context_folder(tmp_path_factory.mktemp("models") / "tiny-long")
    with qkv_serve(folder) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.slow
def test_json_schema_replies_parse_and_validate_20_of_20(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(seed: int):  # sampled at temperature 1: twenty different walks through the grammar
        return client.chat.completions.create(model="tiny-long", messages=MESSAGES, max_tokens=200, seed=seed,
                                              temperature=1.0, response_format=fmt).choices[0]

    # Four at a time: the server's four slots decode together, each row under its own matcher.
    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(ask, range(20)))
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({c.message.content for c in choices}) > 10


def test_json_schema_on_completions_and_streamed(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    text = client.completions.create(model="tiny-long", prompt="A person:", max_tokens=200, seed=3,
                                     extra_body={"response_format": fmt}).choices[0].text
    jsonschema.validate(json.loads(text), PERSON)
    chunks = client.chat.completions.create(model="tiny-long", messages=MESSAGES, max_tokens=200, seed=4,
                                            response_format=fmt, stream=True)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), PERSON)


def test_json_object_replies_are_objects_when_complete(client) -> None:
    ends = []
    for seed in range(4):
        choice = client.chat.completions.create(model="tiny-long", messages=MESSAGES, max_tokens=60, seed=seed,
                                                response_format={"type": "json_object"}).choices[0]
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        ends.append(choice.finish_reason)
    assert set(ends) <= {"stop", "length"}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_come_back_as_tool_calls(client, tool_choice) -> None:
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
             "properties": {}, "additionalProperties": False}}}
    reply = client.chat.completions.create(model="tiny-long", messages=MESSAGES, max_tokens=200, seed=1,
                                           tools=[WEATHER, other], tool_choice=tool_choice)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"get_weather": WEATHER, "get_time": other}[call.function.name]
    if not isinstance(tool_choice, str):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_a_tool_call_round_trip_and_a_streamed_call(client) -> None:
    first = client.chat.completions.create(model="tiny-long", messages=MESSAGES, max_tokens=200,
                                           tools=[WEATHER], tool_choice="required").choices[0].message
    call = first.tool_calls[0]
    history = [*MESSAGES, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    again = client.chat.completions.create(model="tiny-long", messages=history, max_tokens=5, tools=[WEATHER],
                                           tool_choice="none")
    assert again.choices[0].finish_reason in ("stop", "length") and again.choices[0].message.tool_calls is None
    assert again.usage.prompt_tokens > len(json.dumps(call.model_dump())) // 4  # the call was rendered back
    stream = client.chat.completions.create(model="tiny-long", messages=MESSAGES, max_tokens=200, stream=True,
                                            tools=[WEATHER], tool_choice="required")
    parts, finish = {}, None
    for chunk in stream:
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            entry = parts.setdefault(delta_call.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = delta_call.id or entry["id"]
            entry["name"] += (delta_call.function.name or "") if delta_call.function else ""
            entry["arguments"] += (delta_call.function.arguments or "") if delta_call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and parts[0]["name"] == "get_weather" and parts[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(parts[0]["arguments"]), WEATHER["function"]["parameters"])


def test_bad_structured_fields_are_refused_by_name(client) -> None:
    cases = [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}},
         "response_format.json_schema.extra"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "format": "no-such-format"}}}}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model="tiny-long", messages=MESSAGES, max_tokens=5, extra_body=extra)
        assert raised.value.body["param"] == param, (extra, raised.value.body)
    with pytest.raises(openai.BadRequestError, match="chat/completions"):
        client.completions.create(model="tiny-long", prompt="x", max_tokens=2, extra_body={"tools": [WEATHER]})


def test_folder_name_is_the_model(url: str, tmp_path: Path) -> None:
    assert openai.OpenAI(base_url=url + "/v1", api_key="x").models.list().data[0].id == "tiny-long"


def test_metrics_count_the_prompt_tokens_reused(client, url: str) -> None:
    import httpx

    def reused() -> int:
        lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
        return int(next(line for line in lines if line.startswith("qkv_prompt_tokens_reused_total ")).split()[1])

    system = {"role": "system", "content": "Keys, queries and values. " * 8}
    before = reused()
    for question in ("The cat?", "The mat?"):
        first = client.chat.completions.create(model="tiny-long", messages=[system, {"role": "user", "content": question}],
                                               max_tokens=2)
    assert reused() - before >= first.usage.prompt_tokens // 2  # the second prompt's shared system turn
