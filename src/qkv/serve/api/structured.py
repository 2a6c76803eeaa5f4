"""Structured output for the OpenAI routes: `response_format` and `tools` turned into a
grammar the engine enforces per request, and the reply turned back into OpenAI's shapes.

    fields = parse_fields(body, chat=True)       # response_format, tools, tool_choice, ... checked
    plan = Plan.for_request(req, served)         # the grammar (if any) and the tool format
    text = plan.render(template, req.messages)   # the prompt, with the tools shown to the model
    Job(..., constraint=plan.constraint())       # one matcher per job (n > 1: one per choice)
    message, finish = plan.message(text, finish) # content or tool_calls, finish_reason

response_format:
- {"type": "text"} (or none): free text.
- {"type": "json_object"}: the reply is one JSON object (any keys).
- {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}: the
  reply is JSON valid under `schema`, whatever `strict` says (qkv always enforces it);
  a schema feature the grammar compiler cannot enforce is refused with a 400 naming it.
Both are enforced token by token (qkv.generation.constraints), so a reply that ends with
finish_reason "stop" always parses (and validates); one cut by max_tokens ("length") may not,
as with OpenAI's API. A schema too deep, or recursive with no finite document, is a 400
(qkv.generation.schema_limits); numbers, strings and arrays it leaves unbounded get bounds,
so a model cannot fill one integer with digits until max_tokens.

A forced tool call (tool_choice 'required' or a named function) cut off by max_tokens is
still returned as a `tool_calls` entry, its arguments the JSON written so far, with
finish_reason "length", as OpenAI's API returns one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qkv.errors import QkvError
from qkv.generation.constraints import Constraint, Grammars, json_schema_grammar, lark_grammar
from qkv.generation.schema_limits import ANY_JSON_OBJECT
from qkv.serve.api import tools as tool_calls
from qkv.serve.errors import ApiError


def _response_format(value: Any) -> dict[str, Any] | None:
    """The JSON schema the reply must follow (None: free text)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                       param="response_format")
    kind = value["type"]
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ApiError(400, f"'response_format.{unknown[0]}' is not supported with type '{kind}'",
                       param=f"response_format.{unknown[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_JSON_OBJECT  # {"type": "object"}, its values bounded
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ApiError(400, "'response_format.json_schema' must be an object with a 'name' and a 'schema'",
                       param="response_format.json_schema")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise ApiError(400, f"'response_format.json_schema.{unknown[0]}' is not supported",
                       param=f"response_format.json_schema.{unknown[0]}")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema object",
                       param="response_format.json_schema.schema")
    if spec.get("strict") not in (None, True, False):
        raise ApiError(400, "'response_format.json_schema.strict' must be a boolean",
                       param="response_format.json_schema.strict")
    return schema


def parse_fields(body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    """The structured-output fields of a request body, checked: keyword arguments for
    CompletionRequest (response_format as the schema to follow; tools as Tools)."""
    schema = _response_format(body.get("response_format"))
    tools: list[tool_calls.Tool] | None = None
    choice = "none"
    if not chat:
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if body.get(name) is not None:
                raise ApiError(400, f"'{name}' is a chat field; use /v1/chat/completions", param=name)
    elif body.get("tools") is not None:
        tools = tool_calls.parse_tools(body["tools"])
        choice = tool_calls.parse_tool_choice(body.get("tool_choice"), tools)
    elif body.get("tool_choice") not in (None, "none"):
        raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if schema is not None and tools is not None and choice != "none":
        raise ApiError(400, "'response_format' and 'tools' (with tool_choice other than 'none') cannot be "
                            "combined: the reply is either a JSON document or a tool call", param="response_format")
    return {"response_schema": schema, "tools": tools if choice != "none" else None, "tool_choice": choice,
            "parallel_tool_calls": True if parallel is None else parallel}


def grammars_for(served: Any) -> Grammars:
    """The served model's grammar compiler, built on first use (~0.3-0.5 s) and kept."""
    grammars = getattr(served, "grammars", None)
    if grammars is None:
        grammars = Grammars(served.tokenizer, vocab_size=served.model.cfg.vocab_size, stop_ids=served.stop_ids)
        served.grammars = grammars
    return grammars


@dataclass
class Plan:
    """What one request's structured fields make of it."""

    grammar: str | None = None  # what every reply of the request must follow
    grammars: Grammars | None = None
    tools: list[tool_calls.Tool] | None = None  # shown to the model (tool_choice not 'none')
    tool_format: str = "json"
    parallel: bool = True
    forced: bool = False  # the grammar is a tool call (tool_choice 'required' or a named function)

    def constraint(self) -> Constraint | None:
        """A fresh matcher for one answer (each row keeps its own state), or None: free text."""
        if self.grammar is None or self.grammars is None:
            return None
        try:
            return self.grammars.constraint(self.grammar)
        except QkvError as error:
            raise ApiError(400, str(error), param="response_format") from None

    @classmethod
    def for_request(cls, req: Any, served: Any) -> Plan:
        template = served.template
        fmt = tool_calls.template_format(template.source) if template is not None else "json"
        plan = cls(tools=req.tools, tool_format=fmt, parallel=req.parallel_tool_calls)
        grammar: str | None = None
        try:
            if req.response_schema is not None:
                grammar = json_schema_grammar(req.response_schema)
            elif req.tools and req.tool_choice != "auto":
                kind, source = tool_calls.call_grammar_source(req.tools, req.tool_choice, fmt)
                grammar = json_schema_grammar(source) if kind == "json" else lark_grammar(source["lark"])
                plan.forced = True
            if grammar is not None:
                plan.grammars = grammars_for(served)
                plan.grammars.check(grammar)
                plan.grammar = grammar
        except QkvError as error:
            param = "response_format" if req.response_schema is not None else "tools"
            raise ApiError(400, str(error), param=param) from None
        return plan

    def render(self, template: Any, messages: list[dict[str, Any]]) -> str:
        shown, tools_arg = tool_calls.render_messages(messages, self.tools, self.tool_format)
        return template.render(shown, tools=tools_arg)

    @property
    def buffers(self) -> bool:
        """Whether the reply must be read whole before it is sent (it may be a tool call)."""
        return bool(self.tools)

    def message(self, text: str, finish: str) -> tuple[dict[str, Any], str]:
        """The assistant message for `text`, and the finish_reason ('tool_calls' for calls;
        a forced call cut off by max_tokens stays a call, its arguments incomplete, 'length')."""
        if self.tools and self.forced and finish == "length":
            calls = tool_calls.cut_call(text, self.tools)
            if calls:
                return {"role": "assistant", "content": None, "tool_calls": calls}, "length"
        if self.tools and finish == "stop":
            content, calls = tool_calls.read_calls(text, self.tools, self.tool_format)
            if calls:
                return ({"role": "assistant", "content": content, "tool_calls": calls if self.parallel else calls[:1]},
                        "tool_calls")
        return {"role": "assistant", "content": text}, finish
