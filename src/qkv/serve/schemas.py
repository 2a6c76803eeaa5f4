"""OpenAI request bodies, checked by hand into small dataclasses; and the error shape.

Every problem is an `ApiError` with an HTTP status and one clear line, answered as
    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
like OpenAI's API, so its clients raise their usual exceptions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qkv.serve.tools import Tool

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 422: "invalid_request_error", 500: "server_error",
               503: "server_overloaded"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 1024  # the most new tokens one request may ask for


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | None  # /v1/completions
    messages: list[dict[str, str]] | None  # /v1/chat/completions
    max_tokens: int
    temperature: float
    top_p: float | None
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    # -- structured output and tools (checked by qkv.serve.structured.parse_fields) --
    response_schema: dict[str, Any] | None = None  # response_format: the JSON schema the reply follows
    tools: list[Tool] | None = None  # shown to the model (None when tool_choice is 'none')
    tool_choice: str = "none"  # 'none' | 'auto' | 'required' | a function's name
    parallel_tool_calls: bool = True


def _typed(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
        raise ApiError(422, f"'{name}' must be {what}, got {type(value).__name__}", param=name)
    return value


def parse(body: Any, *, chat: bool, limits: Limits) -> CompletionRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = _typed(body, "model", (str,), "a string")
    if model is None:
        raise ApiError(400, "'model' is required", param="model")
    prompt, messages = None, None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(422 if "messages" in body else 400, "'messages' must be a non-empty list", param="messages")
        for i, message in enumerate(messages):
            # (structured output) an assistant message may carry tool_calls and content null
            calls = isinstance(message, dict) and message.get("role") == "assistant" and message.get("tool_calls")
            if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                    or not (isinstance(message.get("content"), str) or calls and message.get("content") is None)):
                raise ApiError(422, f"messages[{i}] must be an object with string 'role' and 'content'",
                               param="messages")
        kept = ("role", "content", "tool_calls", "tool_call_id", "name")
        messages = [{k: m[k] for k in kept if m.get(k) is not None} | {"content": m.get("content")} for m in messages]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(422 if "prompt" in body else 400, "'prompt' must be a string", param="prompt")
    max_tokens = _typed(body, "max_completion_tokens", (int,), "an integer", None)
    max_tokens = _typed(body, "max_tokens", (int,), "an integer", max_tokens)
    if max_tokens is None:
        max_tokens = min(16 if not chat else 256, limits.max_tokens)
    if not 1 <= max_tokens <= limits.max_tokens:
        raise ApiError(400, f"'max_tokens' must be between 1 and {limits.max_tokens}, got {max_tokens}",
                       param="max_tokens")
    temperature = float(_typed(body, "temperature", (int, float), "a number", 1.0))
    if not math.isfinite(temperature) or not 0.0 <= temperature <= 2.0:
        raise ApiError(400, f"'temperature' must be between 0 and 2, got {temperature}", param="temperature")
    top_p = _typed(body, "top_p", (int, float), "a number")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    seed = _typed(body, "seed", (int,), "an integer")
    if seed is not None and not 0 <= seed < 2**63:
        raise ApiError(400, f"'seed' must be in [0, 2**63), got {seed}", param="seed")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(422, "'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
    stream = _typed(body, "stream", (bool,), "a boolean", False)
    options = _typed(body, "stream_options", (dict,), "an object", {})
    include_usage = options.get("include_usage", False) is True
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    from qkv.serve.structured import parse_fields

    return CompletionRequest(model, prompt, messages, max_tokens, temperature,
                             None if top_p is None else float(top_p), seed, stop, stream, include_usage,
                             **parse_fields(body, chat=chat))
