"""Request bodies parsed as JSON defensively: every malformed number or string is a 400.

    value = parse_json(raw_bytes)   # or ApiError(400, "...one line naming the problem...")

Python's `json.loads` alone lets through what later turns into a 500 or worse: numbers
beyond a double (`1e400` parses as inf; `NaN` and `Infinity` are accepted), integers too long
for `int()` (over 4,300 digits raise ValueError; long ones cost quadratic time), nesting that
raises RecursionError, and lone UTF-16 surrogates (`"\\ud800"`) that no tokenizer or UTF-8
encoder takes. Here the body must be UTF-8, numbers are finite and short, and after parsing
one iterative walk (no recursion) bounds the depth and refuses lone surrogates, naming where.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import ClientDisconnect, Request

from qkv.serve.api.schemas import ApiError

MAX_DEPTH = 64  # arrays and objects inside each other; OpenAI bodies need fewer than 10
MAX_INT_DIGITS = 40  # an int64 has 19 digits; anything longer is no request field's value
MAX_NUMBER_CHARS = 64  # a float's text ("-1.2345678901234567e-308" is 24)


class _Refused(ValueError):
    """A value the parser will not make; its message names it."""


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise _Refused(f"a number written with {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text}, beyond a double's range (about 1.8e308)")
    return value


def _parse_constant(name: str) -> float:
    raise _Refused(f"{name}, which is not JSON (send a finite number)")


JsonPath = tuple  # (parent path, key or index), () at the top: made per value, joined only for a message


def _where(path: JsonPath) -> tuple[str, str | None]:
    """A path like messages[0].content, and its first part (the request field)."""
    parts: list[str | int] = []
    while path:
        path, part = path
        parts.append(part)
    parts.reverse()
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "the top level", (str(parts[0]) if parts else None)


def _lone_surrogate(text: str) -> int | None:
    """The first lone surrogate's code point in `text`, if any (json pairs the others up).
    ASCII is checked in C at once; other text by the UTF-8 encoder, which stops at one."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return ord(text[error.start])
    return None


def _check_tree(value: Any) -> None:
    """Depth at most MAX_DEPTH and no lone surrogate in any string or key (iteratively)."""
    stack: list[tuple[Any, int, JsonPath]] = [(value, 0, ())]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            surrogate = _lone_surrogate(item)
            if surrogate is not None:
                where, field = _where(path)
                raise ApiError(400, f"the request body has a lone UTF-16 surrogate (\\u{surrogate:04x}) "
                               f"at {where}; strings must be valid Unicode", param=field)
            continue
        if depth >= MAX_DEPTH:
            raise ApiError(400, f"the request body is nested deeper than {MAX_DEPTH} levels at {_where(path)[0]}")
        children = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in children:
            if isinstance(key, str) and _lone_surrogate(key) is not None:
                raise ApiError(400, f"the request body has a lone UTF-16 surrogate in a key at {_where(path)[0]}; "
                               "strings must be valid Unicode")
            if isinstance(child, (str, dict, list)):
                stack.append((child, depth + 1, (path, key)))


def parse_json(raw: bytes) -> Any:
    """The JSON value of a request body, or ApiError(400) naming what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(400, f"the request body is not UTF-8 (byte {error.start} is not valid); "
                       "send JSON in UTF-8") from None
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except _Refused as error:
        raise ApiError(400, f"the request body has {error}") from None
    except RecursionError:
        raise ApiError(400, f"the request body is nested deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    except ValueError as error:  # any other conversion json.loads could not make
        raise ApiError(400, f"the request body has a value JSON cannot hold: {error}") from None
    if isinstance(value, (str, dict, list)):
        _check_tree(value)
    return value


async def read_json_body(request: Request, max_bytes: int) -> Any:
    """The request's body read under `max_bytes` (declared or streamed) and parsed by `parse_json`;
    too large -> 413, a client that left mid-body -> 408."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the request body is over {max_bytes} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise ApiError(413, f"the request body is over {max_bytes} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # the client left, or its body missed the read deadline
        raise ApiError(408, "the connection closed before the whole request body arrived") from None
    return parse_json(b"".join(chunks))
