"""OpenAI request bodies, checked by hand into one small dataclass.

Every field of OpenAI's chat and completions requests is either honoured (the `_HONOURED`
tables) or refused with a 400 that names it (`param`); so is any field OpenAI does not
define. A field sent as null counts as not sent (OpenAI's optional fields are nullable),
and a refused field may carry its default value (`store: false`, `modalities: ["text"]`).
Problems are `ApiError`s (qkv.serve.errors), all 400 (a value of the wrong type, out of
range, or a field qkv does not do), as OpenAI's API answers them: its SDKs raise
`BadRequestError` for a 400, and a 422 would surface as an `UnprocessableEntityError` that
client code written against OpenAI does not catch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qkv.serve.errors import ERROR_TYPES, ApiError

if TYPE_CHECKING:
    from qkv.serve.api.tools import Tool

__all__ = ["ERROR_TYPES", "ApiError", "CompletionRequest", "Limits", "parse"]


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 1024  # the most new tokens one request may ask for
    max_choices: int = 64  # prompts x n (or x best_of) in one request


MAX_TOP_LOGPROBS = 20

_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
           "logit_bias", "presence_penalty", "frequency_penalty", "logprobs", "user"}
_HONOURED = {  # structured output and tools: qkv.serve.api.structured
    True: _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
                     "parallel_tool_calls"},  # /v1/chat/completions
    False: _COMMON | {"prompt", "echo", "best_of", "response_format"},  # /v1/completions
}

# OpenAI fields qkv does not do, refused by name unless they carry their default value.
_REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "suffix": ("qkv's models do not fill in the middle", ("",)),
    "audio": ("qkv serves text models", ()),
    "modalities": ("qkv serves text models: only [\"text\"]", (["text"],)),
    "prediction": ("predicted outputs are not supported", ()),
    "reasoning_effort": ("qkv's models do not reason on a budget", ()),
    "verbosity": ("not supported", ()),
    "service_tier": ("qkv has one tier", ("auto", "default")),
    "store": ("qkv stores no completions", (False,)),
    "metadata": ("qkv stores no completions to tag", ()),
    "web_search_options": ("qkv does not search the web", ()),
    "prompt_cache_key": ("not supported", ()),
    "prompt_cache_retention": ("not supported", ()),
    "prompt_cache_options": ("not supported", ()),
    "safety_identifier": ("not supported", ()),
}

_NOT_YET: dict[str, tuple[str, tuple[Any, ...]]] = {
    "functions": ("functions are deprecated by OpenAI and not supported; use tools", ()),
    "function_call": ("functions are deprecated by OpenAI and not supported; use tools", ()),
}


Prompt = str | list[int]  # text, or token ids


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: list[Prompt] | None  # /v1/completions: one choice group per prompt
    messages: list[dict[str, Any]] | None  # /v1/chat/completions, as the chat template takes them
    max_tokens: int  # 0 only with echo (score the prompt, generate nothing)
    temperature: float
    top_p: float | None
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    n: int = 1  # choices returned per prompt
    best_of: int = 1  # candidates generated per prompt; the n of highest mean logprob are returned
    logprobs: int | None = None  # alternatives per token (0: the chosen token's only); None: no logprobs
    echo: bool = False  # completions: the prompt comes back (text and, with logprobs, its tokens' logprobs)
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None  # the end user's id: metadata OpenAI uses to watch abuse; qkv keeps none
    # -- structured output and tools (checked by qkv.serve.api.structured.parse_fields) --
    response_schema: dict[str, Any] | None = None  # response_format: the JSON schema the reply follows
    tools: list[Tool] | None = None  # shown to the model (None when tool_choice is 'none')
    tool_choice: str = "none"  # 'none' | 'auto' | 'required' | a function's name
    parallel_tool_calls: bool = True


def _typed(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
        raise ApiError(400, f"'{name}' must be {what}, got {type(value).__name__}", param=name)
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float, default: float) -> float:
    value = float(_typed(body, name, (int, float), "a number", default))
    if not math.isfinite(value) or not low <= value <= high:
        raise ApiError(400, f"'{name}' must be between {low:g} and {high:g}, got {value}", param=name)
    return value


def _check_fields(body: dict[str, Any], chat: bool) -> None:
    honoured = _HONOURED[chat]
    for name, value in body.items():
        if name in honoured or value is None:
            continue
        reason, defaults = _REFUSED.get(name) or _NOT_YET.get(name) or ("", ())
        if reason and value in defaults:
            continue
        if not reason:
            other = _HONOURED[not chat]
            reason = (f"it belongs to /v1/{'completions' if chat else 'chat/completions'}" if name in other
                      else "it is not a field of OpenAI's API")
        raise ApiError(400, f"'{name}' is not supported by this server: {reason}", param=name,
                       code="unsupported_parameter")


def _prompts(body: dict[str, Any], vocab_size: int | None) -> list[Prompt]:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        return [prompt]
    shape = "'prompt' must be a string, a list of strings, a list of token ids, or a list of lists of token ids"
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(400, shape, param="prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompts: list[Prompt] = [prompt]
    elif all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
             for p in prompt):
        prompts = list(prompt)
    else:
        raise ApiError(400, shape, param="prompt")
    for p in prompts:
        if isinstance(p, list) and vocab_size is not None and not all(0 <= t < vocab_size for t in p):
            bad = next(t for t in p if not 0 <= t < vocab_size)
            raise ApiError(400, f"token id {bad} in 'prompt' is outside the vocabulary (0..{vocab_size - 1})",
                           param="prompt")
    return prompts


def _logit_bias(body: dict[str, Any], vocab_size: int | None) -> dict[int, float]:
    bias = _typed(body, "logit_bias", (dict,), "an object mapping token ids to numbers", {})
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit()) or vocab_size is not None and int(key) >= vocab_size:
            raise ApiError(400, f"'logit_bias' key '{str(key)[:20]}' is not a token id of this model "
                           f"(0..{(vocab_size or 1) - 1})", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise ApiError(400, f"'logit_bias' values must be numbers in [-100, 100], got {value!r} for {key}",
                           param="logit_bias")
        out[int(key)] = float(value)
    return out


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    if chat:
        wanted = _typed(body, "logprobs", (bool,), "a boolean", False)
        top = _typed(body, "top_logprobs", (int,), "an integer")
        if top is not None and not wanted:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        name, count = "top_logprobs", (top or 0) if wanted else None
    else:
        name, count = "logprobs", _typed(body, "logprobs", (int,), "an integer")
    if count is not None and not 0 <= count <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"'{name}' must be between 0 and {MAX_TOP_LOGPROBS}, got {count}", param=name)
    return count


def parse(body: Any, *, chat: bool, limits: Limits, vocab_size: int | None = None) -> CompletionRequest:
    """Check a request body against the endpoint (`chat` or completions) and the server's limits;
    token ids (prompts, logit_bias) against `vocab_size` when it is given."""
    from qkv.serve.api.messages import parse_messages
    from qkv.serve.api.structured import parse_fields

    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_fields(body, chat)
    model = _typed(body, "model", (str,), "a string")
    if model is None:
        raise ApiError(400, "'model' is required", param="model")
    prompts, messages = None, None
    if chat:
        if "messages" not in body:
            raise ApiError(400, "'messages' is required", param="messages")
        messages = parse_messages(body["messages"])
    else:
        prompts = _prompts(body, vocab_size)
    echo = False if chat else _typed(body, "echo", (bool,), "a boolean", False)
    max_tokens = _typed(body, "max_completion_tokens", (int,), "an integer", None)
    max_tokens = _typed(body, "max_tokens", (int,), "an integer", max_tokens)
    if max_tokens is None:
        max_tokens = min(16 if not chat else 256, limits.max_tokens)
    low = 0 if echo else 1
    if not low <= max_tokens <= limits.max_tokens:
        hint = "" if chat or echo else " (0 only with echo)"
        raise ApiError(400, f"'max_tokens' must be between {low}{hint} and {limits.max_tokens}, got {max_tokens}",
                       param="max_tokens")
    temperature = _number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _typed(body, "top_p", (int, float), "a number")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    seed = _typed(body, "seed", (int,), "an integer")
    if seed is not None and not 0 <= seed < 2**63:
        raise ApiError(400, f"'seed' must be in [0, 2**63), got {seed}", param="seed")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
    stream = _typed(body, "stream", (bool,), "a boolean", False)
    options = _typed(body, "stream_options", (dict,), "an object", {})
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise ApiError(400, f"'stream_options.{unknown[0]}' is not supported", param=f"stream_options.{unknown[0]}")
    include_usage = _typed(options, "include_usage", (bool,), "a boolean", False)
    if options and not stream:
        raise ApiError(400, "'stream_options' needs 'stream': true", param="stream_options")
    n = _typed(body, "n", (int,), "an integer", 1)
    best_of = _typed(body, "best_of", (int,), "an integer", n)
    if n < 1 or best_of < n:
        raise ApiError(400, f"'n' must be at least 1 and 'best_of' at least n, got n={n}, best_of={best_of}",
                       param="n" if n < 1 else "best_of")
    if stream and best_of > n:
        raise ApiError(400, "'best_of' above n cannot be streamed (the best are known only at the end)",
                       param="best_of")
    choices = len(prompts or [None]) * best_of
    if choices > limits.max_choices:
        raise ApiError(400, f"this request asks for {choices} completions (prompts x best_of or n); the most is "
                       f"{limits.max_choices}", param="n")
    user = _typed(body, "user", (str,), "a string")
    return CompletionRequest(
        model, prompts, messages, max_tokens, temperature, None if top_p is None else float(top_p), seed, stop,
        stream, include_usage, n=n, best_of=best_of, logprobs=_logprobs(body, chat), echo=echo,
        logit_bias=_logit_bias(body, vocab_size),
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0, 0.0), user=user,
        **parse_fields(body, chat=chat))
