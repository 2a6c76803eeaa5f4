"""Tools (function calling): how the model is told about them, and its reply read back.

Two tool-call formats, chosen from the model's chat template:

- "hermes": the template itself teaches tools (its source has `<tool_call>`, as Qwen 2.5/3
  and Hermes templates do). It is rendered with `tools=[...]`, and a call is written
      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>
- "json": every other template (SmolLM2's among them) knows nothing of tools. qkv then adds
  the tool list to the system message, with this instruction, and a call is the bare reply
      {"name": "get_weather", "arguments": {"city": "Paris"}}
  (several calls: a JSON list of such objects).

Either way earlier assistant calls (`tool_calls`) are rendered back in the same format and
`role: "tool"` results are rendered as tool messages, so a conversation round-trips.
tool_choice "required" or a named function constrains the reply, token by token, to one
call in the format (qkv.generation.constraints); "auto" lets the model choose and reads the
reply (a bare call, or one in a ```json code block); "none" does not show the tools at all.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from qkv.generation.constraints import prepared
from qkv.serve.errors import ApiError

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
CUT_CALL = re.compile(r'\s*(?:<tool_call>\s*)?\{"name": "((?:[^"\\]|\\.)*)"?(?:, "arguments": (.*))?', re.DOTALL)
FENCED = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)  # a call a model put in a code block
JSON_FORMAT_INSTRUCTION = (
    "Tools you can call:\n{tools}\nTo call one, reply with only "
    '{{"name": <its name>, "arguments": <an object of its arguments>}}. Its result comes back as a tool message.')


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def spec(self) -> dict[str, Any]:
        """The OpenAI shape, as chat templates expect it."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema of one call of this tool: {"name": ..., "arguments": {...}}. Objects
        in the parameters that list their properties and say nothing of others are closed
        (`additionalProperties: false`, as OpenAI's strict mode asks): a forced call then
        names the function's own arguments only, instead of inventing keys until max_tokens.
        The arguments are their own resource (an `$id`), so that the parameters' `$ref`s
        (`#/$defs/...`, as pydantic writes them, or `#`) still point into the parameters."""
        arguments = {"$id": f"https://qkv.invalid/tools/{self.name}/arguments", **closed(self.parameters)}
        return {"type": "object", "properties": {"name": {"const": self.name}, "arguments": arguments},
                "required": ["name", "arguments"], "additionalProperties": False}


def closed(schema: Any) -> Any:
    """`schema` with every object that has `properties` and no `additionalProperties` closed."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed(value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _refuse(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def parse_tools(value: Any) -> list[Tool]:
    """`tools` of a chat request -> Tools (function tools only; anything else refused by name)."""
    if not isinstance(value, list) or not value:
        raise _refuse("tools", "'tools' must be a non-empty list of {'type': 'function', 'function': {...}}")
    tools: list[Tool] = []
    for i, item in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(item.get("function"), dict):
            raise _refuse(where, f"'{where}' must be {{'type': 'function', 'function': {{...}}}} (only function "
                                 "tools are supported)")
        unknown = sorted(set(item) - {"type", "function"})
        if unknown:
            raise _refuse(f"{where}.{unknown[0]}", f"'{where}.{unknown[0]}' is not supported")
        function = item["function"]
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise _refuse(f"{where}.function.{unknown[0]}", f"'{where}.function.{unknown[0]}' is not supported")
        name, description = function.get("name"), function.get("description")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_\-.]{1,64}", name):
            raise _refuse(f"{where}.function.name", f"'{where}.function.name' must be 1-64 letters, digits, _ - or .")
        if description is not None and not isinstance(description, str):
            raise _refuse(f"{where}.function.description", f"'{where}.function.description' must be a string")
        if not isinstance(parameters, dict):
            raise _refuse(f"{where}.function.parameters", f"'{where}.function.parameters' must be a JSON schema object")
        if any(t.name == name for t in tools):
            raise _refuse(f"{where}.function.name", f"two tools are named '{name}'")
        tools.append(Tool(name, description, parameters))
    return tools


def parse_tool_choice(value: Any, tools: list[Tool]) -> str:
    """'none' | 'auto' | 'required' | the name of the one function to call."""
    if value is None:
        return "auto"
    if value in ("none", "auto", "required"):
        return str(value)
    if (isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict)
            and isinstance(value["function"].get("name"), str)):
        name = value["function"]["name"]
        if not any(t.name == name for t in tools):
            raise _refuse("tool_choice", f"'tool_choice' names the function '{name}', which is not in 'tools'")
        return name
    raise _refuse("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                                 "{'type': 'function', 'function': {'name': ...}}")


def template_format(template_source: str) -> str:
    """'hermes' when the chat template teaches <tool_call> blocks itself, else 'json'."""
    return "hermes" if "<tool_call>" in template_source and "tools" in template_source else "json"


def _arguments_object(call: dict[str, Any]) -> tuple[str, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # shown to the model as the string it was
    return str(function.get("name", "")), arguments


def render_messages(messages: list[dict[str, Any]], tools: list[Tool] | None, fmt: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages a chat template can render, the `tools` argument for it). Assistant tool
    calls become text in the format, or (hermes) stay structured with object arguments,
    as those templates expect; tool results keep the role 'tool'."""
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None) or []
        if message.get("content") is None:
            message["content"] = ""
        if calls and fmt == "hermes":
            message["tool_calls"] = [{"type": "function", "function": dict(zip(("name", "arguments"),
                                                                            _arguments_object(c)))}
                                     for c in calls]
        elif calls:
            written = [{"name": n, "arguments": a} for n, a in map(_arguments_object, calls)]
            text = json.dumps(written[0] if len(written) == 1 else written, ensure_ascii=False)
            message["content"] = (message["content"] + "\n" + text).strip()
        out.append(message)
    if not tools:
        return out, None
    if fmt == "hermes":
        return out, [t.spec() for t in tools]
    listing = json.dumps([t.spec()["function"] for t in tools], ensure_ascii=False)
    instruction = JSON_FORMAT_INSTRUCTION.format(tools=listing)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": (str(out[0]["content"]) + "\n\n" + instruction).strip()}
    else:
        out.insert(0, {"role": "system", "content": instruction})
    return out, None


def call_grammar_source(tools: list[Tool], choice: str, fmt: str) -> tuple[str, dict[str, Any]]:
    """('json' or 'lark', source) of the grammar for a reply that is one call: of the named
    function, or (choice 'required') of any of the tools."""
    chosen = [t for t in tools if t.name == choice] if choice != "required" else tools
    schema = chosen[0].call_schema() if len(chosen) == 1 else {"anyOf": [t.call_schema() for t in chosen]}
    if fmt == "json":
        return "json", schema
    return "lark", {"lark": 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json '
                            + json.dumps(prepared(schema)) + "\n"}


def read_calls(text: str, tools: list[Tool], fmt: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The reply's (content, tool_calls in OpenAI's shape): calls of known tools only; a
    reply that is not a call stays content."""
    names = {t.name for t in tools}
    found: list[Any] = []
    rest = text
    if fmt == "hermes":
        for block in HERMES_CALL.findall(text):
            try:
                found.append(json.loads(block))
            except json.JSONDecodeError:
                return text, []
        rest = HERMES_CALL.sub("", text).strip()
    else:
        fenced = FENCED.fullmatch(text)
        try:
            value = json.loads(fenced.group(1) if fenced else text.strip())
        except json.JSONDecodeError:
            return text, []
        found = value if isinstance(value, list) else [value]
        rest = ""
    calls = []
    for item in found:
        if (not isinstance(item, dict) or item.get("name") not in names
                or not isinstance(item.get("arguments", {}), dict)):
            return text, []
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": item["name"],
                                   "arguments": json.dumps(item.get("arguments", {}), ensure_ascii=False)}})
    return (rest or None) if calls else text, calls


def cut_call(text: str, tools: list[Tool]) -> list[dict[str, Any]]:
    """A forced call cut off by max_tokens, as OpenAI returns one: a `tool_calls` entry whose
    arguments are the JSON written so far (incomplete). The grammar wrote the call's head,
    so the name is the one tool it begins (the whole name once written); [] if not even
    the name was begun."""
    head = CUT_CALL.match(text)
    if head is None:
        return []
    begun = [t.name for t in tools if t.name.startswith(head.group(1))]
    name = head.group(1) if head.group(1) in begun or len(begun) != 1 else begun[0]
    arguments = head.group(2) or ""
    try:  # complete after all (cut off in the call's closing "}" or "</tool_call>"): just those
        arguments = json.dumps(json.JSONDecoder().raw_decode(arguments)[0], ensure_ascii=False)
    except json.JSONDecodeError:
        pass
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": name, "arguments": arguments}}]
