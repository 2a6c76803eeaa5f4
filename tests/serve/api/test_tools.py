"""Tool calls rendered through real chat templates and read back: SmolLM2's (no tool format
of its own: qkv's JSON format) and a template that teaches <tool_call> blocks."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.chat.conversation import ChatTemplate
from qkv.generation.constraints import Grammars, json_schema_grammar, lark_grammar
from qkv.serve.api.tools import call_grammar_source, parse_tool_choice, parse_tools, read_calls, render_messages, template_format
from tests.conftest import chat_tokenizer

from .structured_server import WEATHER

# Written for this test in the shape such templates take (tools listed in the system turn,
# calls as <tool_call> JSON blocks, results as tool turns).
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>Tools: {% for t in tools %}{{ t.function | tojson }}{% endfor %}"
    " Call one as <tool_call>{...}</tool_call>.<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "\n</tool_call>{% endfor %}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def smollm2_template() -> ChatTemplate:
    from qkv.models.loader import open_model

    source = open_model("smollm2", chat=True).template
    return ChatTemplate(source.source, bos_token=source.bos_token, eos_token=source.eos_token)


def _conversation(arguments: str) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]


def test_smollm2_gets_tools_in_its_system_turn_and_calls_round_trip(smollm2_template) -> None:
    tools = parse_tools([WEATHER])
    assert template_format(smollm2_template.source) == "json"
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    shown, tools_arg = render_messages(_conversation(arguments), tools, "json")
    text = smollm2_template.render(shown, tools=tools_arg)
    assert text.startswith("<|im_start|>system\nTools you can call:\n[{\"name\": \"get_weather\"")
    written = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    assert f"<|im_start|>assistant\n{written}<|im_end|>" in text  # the call, as the model would write it
    assert text.endswith("<|im_start|>tool\n21 C<|im_end|>\n<|im_start|>assistant\n")
    content, calls = read_calls(written, tools, "json")  # and read back as it went out
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == json.loads(arguments)


def test_a_template_with_a_tool_format_is_given_the_tools(smollm2_template) -> None:
    tools = parse_tools([WEATHER])
    assert template_format(TOOL_TEMPLATE) == "hermes"
    shown, tools_arg = render_messages(_conversation('{"city": "Oslo", "unit": "celsius"}'), tools, "hermes")
    text = ChatTemplate(TOOL_TEMPLATE).render(shown, tools=tools_arg)
    assert text.startswith('<|system|>Tools: {"name": "get_weather"')
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>' in text
    reply = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>'
    content, calls = read_calls(reply, tools, "hermes")
    assert content == "Let me look." and json.loads(calls[0]["function"]["arguments"])["city"] == "Rome"


def test_replies_that_are_not_calls_stay_content() -> None:
    tools = parse_tools([WEATHER])
    fenced = '```json\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n```'
    assert read_calls(fenced, tools, "json")[1][0]["function"]["name"] == "get_weather"
    for reply in ("It is sunny.", '{"name": "other", "arguments": {}}', '{"name": "get_weather", "arguments": 3}', "[1]"):
        assert read_calls(reply, tools, "json") == (reply, [])
    assert read_calls("<tool_call>\nnot json\n</tool_call>", tools, "hermes")[1] == []


@pytest.mark.parametrize("fmt", ["json", "hermes"])
def test_the_forced_call_grammar_takes_a_call_and_nothing_else(fmt) -> None:
    tokenizer = chat_tokenizer()
    tools = parse_tools([WEATHER, {"type": "function", "function": {"name": "now"}}])
    grammars = Grammars(tokenizer, vocab_size=296, stop_ids={tokenizer.token_to_id("<|end|>")})
    call = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
    wrong = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    text = call if fmt == "json" else f"<tool_call>\n{call}\n</tool_call>"
    for choice, accepted in (("get_weather", True), ("required", True), ("now", False)):
        kind, source = call_grammar_source(tools, parse_tool_choice(
            choice if choice == "required" else {"type": "function", "function": {"name": choice}}, tools), fmt)
        grammar = json_schema_grammar(source) if kind == "json" else lark_grammar(source["lark"])
        for document, ok in ((text, accepted), (text.replace(call, wrong), False)):
            constraint = grammars.constraint(grammar)
            allowed = True
            for token in tokenizer.encode(document).ids:
                if constraint.mask(torch.zeros(296))[token].item() == -torch.inf:
                    allowed = False
                    break
                constraint.accept(token)
            assert (allowed and constraint.finished) == ok, (choice, document)


def test_forced_calls_close_objects_that_list_their_properties() -> None:
    """A forced call's arguments hold the function's own properties only (LangChain's
    function_calling schemas say nothing of others); an explicit choice is kept."""
    import jsonschema

    from qkv.serve.api.tools import Tool

    open_params = {"type": "object", "properties": {"city": {"type": "string"},
                                                    "where": {"type": "object", "properties": {"x": {"type": "integer"}}}},
                   "required": ["city"]}
    arguments = Tool("f", None, open_params).call_schema()["properties"]["arguments"]
    jsonschema.validate({"city": "Oslo", "where": {"x": 1}}, arguments)
    for extra in ({"city": "Oslo", "country": "NO"}, {"city": "Oslo", "where": {"x": 1, "y": 2}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(extra, arguments)
    kept = Tool("g", None, {**open_params, "additionalProperties": True}).call_schema()["properties"]["arguments"]
    jsonschema.validate({"city": "Oslo", "country": "NO"}, kept)


def test_a_call_cut_off_keeps_its_name_and_the_arguments_so_far() -> None:
    from qkv.serve.api.tools import cut_call

    tools = parse_tools([WEATHER, {"type": "function", "function": {"name": "get_time"}}])
    written = '{"name": "get_weather", "arguments": {"city": "Par'
    (call,) = cut_call(written, tools)
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Par'} and call["id"].startswith("call_")
    assert cut_call('{"name": "get_ti', tools)[0]["function"]["name"] == "get_time"  # the one tool it begins
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool'
    assert json.loads(cut_call(hermes, tools)[0]["function"]["arguments"]) == {"city": "Rome", "unit": "celsius"}
    assert cut_call('{"na', tools) == []  # not even the name begun: nothing to call


@pytest.mark.parametrize("fmt", ["json", "hermes"])
def test_a_forced_call_of_a_hostile_schema_is_refused_in_both_formats(fmt) -> None:
    """The <tool_call> format embeds the schema in a Lark grammar: it is checked all the same."""
    from qkv.errors import QkvError
    from tests.generation.test_schema_limits import LOOPS, ref_chain

    for parameters, message in ((ref_chain(3_000), "too deep"), (LOOPS["a -> a"], "no finite document")):
        tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": parameters}}])
        with pytest.raises(QkvError, match=message):
            kind, source = call_grammar_source(tools, "required", fmt)
            json_schema_grammar(source) if kind == "json" else lark_grammar(source["lark"])


@pytest.mark.parametrize("fmt", ["json", "hermes"])
def test_a_forced_call_follows_the_parameters_own_refs(fmt) -> None:
    """Parameters as pydantic writes them (nested models in $defs, `#/$defs/...` refs; here
    also `#`, the parameters themselves): the refs resolve inside the parameters, for one
    tool and for a choice of two."""
    import jsonschema

    tokenizer = chat_tokenizer()
    grammars = Grammars(tokenizer, vocab_size=296, stop_ids={tokenizer.token_to_id("<|end|>")})
    parameters = {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}, "again": {"$ref": "#"}},
                  "required": ["city"], "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}},
                                                           "required": ["name"]}}}
    tools = parse_tools([{"type": "function", "function": {"name": name, "parameters": parameters}} for name in "fg"])
    arguments = {"city": {"name": "Oslo"}, "again": {"city": {"name": "Rome"}}}
    jsonschema.validate(arguments, parameters)  # the reference: valid arguments
    call = json.dumps({"name": "g", "arguments": arguments})
    for choice in ("g", "required"):
        kind, source = call_grammar_source(tools, choice, fmt)
        constraint = grammars.constraint(json_schema_grammar(source) if kind == "json" else lark_grammar(source["lark"]))
        for token in tokenizer.encode(call if fmt == "json" else f"<tool_call>\n{call}\n</tool_call>").ids:
            assert constraint.mask(torch.zeros(296))[token].item() == 0, choice
            constraint.accept(token)
        assert constraint.finished
