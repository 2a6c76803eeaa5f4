"""litellm and langchain-openai, unchanged, against a `qkv serve` subprocess on a tiny random
model: json_schema replies validate (20 of 20), and a tool call makes the round trip
(LangChain's bind_tools and with_structured_output, both of its methods)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from .structured_server import PERSON, WEATHER, qkv_serve, tiny_long_context_folder

MESSAGES = [{"role": "user", "content": "Tell me about someone."}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory):
    folder = tiny_long_context_folder(tmp_path_factory.mktemp("models") / "tiny-long")
    with qkv_serve(folder) as base:
        yield base + "/v1"


@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
    return pytest.importorskip("litellm")


@pytest.mark.slow
def test_litellm_json_schema_20_of_20(url, litellm) -> None:
    def ask(seed: int) -> str:
        reply = litellm.completion(model="openai/tiny-long", api_base=url, api_key="none", messages=MESSAGES,
                                   max_tokens=200, temperature=1.0, seed=seed, response_format=FORMAT)
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        for content in pool.map(ask, range(20)):
            jsonschema.validate(json.loads(content), PERSON)


def test_litellm_tool_call_round_trip(url, litellm) -> None:
    first = litellm.completion(model="openai/tiny-long", api_base=url, api_key="none", messages=MESSAGES,
                               max_tokens=200, tools=[WEATHER], tool_choice="required")
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    history = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}]
    again = litellm.completion(model="openai/tiny-long", api_base=url, api_key="none", messages=history,
                               max_tokens=5, tools=[WEATHER], tool_choice="none")
    assert again.choices[0].finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def chat_model(url):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model="tiny-long", base_url=url, api_key="none", max_tokens=200,
                                       max_retries=0, timeout=120)


@pytest.mark.slow
def test_langchain_with_structured_output_json_schema_20_of_20(chat_model) -> None:
    structured = chat_model.with_structured_output(PERSON | {"title": "person"}, method="json_schema", strict=True)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda seed: structured.bind(seed=seed, temperature=1.0).invoke(MESSAGES[0]["content"]),
                                range(20)))
    for answer in answers:
        jsonschema.validate(answer, PERSON)


def test_langchain_with_structured_output_pydantic_both_methods(chat_model) -> None:
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city and its country."""

        name: str = Field(max_length=10)
        population: int = Field(ge=0, le=100_000_000)

    for method in ("json_schema", "function_calling"):
        city = chat_model.with_structured_output(City, method=method).invoke("Name a city.")
        assert isinstance(city, City) and len(city.name) <= 10, method


def test_langchain_bind_tools_round_trip(chat_model) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage

    bound = chat_model.bind_tools([WEATHER], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris?")
    asked = bound.invoke([question])
    (call,) = asked.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])
    answer = chat_model.bind(max_tokens=5).invoke(
        [question, asked, ToolMessage(content="21 degrees", tool_call_id=call["id"])])
    assert answer.response_metadata["finish_reason"] in ("stop", "length") and not answer.tool_calls
