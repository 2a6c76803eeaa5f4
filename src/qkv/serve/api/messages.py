"""Chat messages as OpenAI sends them -> the plain dicts a chat template renders.

Accepted, per role (anything else is refused with a 400 naming it):
    system, developer (rendered as "system": templates know no other), user:
        content: a string or a list of text parts (joined with "\\n"); name
    assistant: content (a string, text parts, or null when tool_calls are given); name;
        tool_calls [{id, type: "function", function: {name, arguments}}], handed to the
        template with `arguments` parsed into an object (transformers' convention)
    tool: content, tool_call_id

Content parts of other types (image_url, input_audio, file, refusal) are refused by name:
qkv serves text models.
"""

from __future__ import annotations

import json
from typing import Any

from qkv.serve.errors import ApiError

ROLES = ("system", "developer", "user", "assistant", "tool")
_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "refusal"},
    "tool": {"role", "content", "tool_call_id"},
}


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ApiError(400, f"{where} must be an object with 'role' and 'content'", param=where)
    role = message.get("role")
    if not isinstance(role, str):
        raise ApiError(400, f"{where}.role must be a string", param=f"{where}.role")
    if role not in ROLES:
        raise ApiError(400, f"{where}.role '{role[:40]}' is not a role qkv knows; use one of {', '.join(ROLES)}",
                       param=f"{where}.role")
    for key, value in message.items():
        if key not in _KEYS[role] and value is not None:
            raise ApiError(400, f"{where}.{key} is not supported on a '{role}' message", param=f"{where}.{key}")
    if message.get("refusal") is not None:
        raise ApiError(400, f"{where}.refusal is not supported: send the refusal text as 'content'",
                       param=f"{where}.refusal")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    tool_calls = message.get("tool_calls")
    content = message.get("content")
    if content is None and not (role == "assistant" and tool_calls):
        raise ApiError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
    out["content"] = None if content is None else _text(content, f"{where}.content")
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise ApiError(400, f"{where}.name must be a string", param=f"{where}.name")
        out["name"] = name
    if tool_calls is not None:
        out["tool_calls"] = _tool_calls(tool_calls, f"{where}.tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise ApiError(400, f"{where}.tool_call_id must be a string (the id of the call it answers)",
                           param=f"{where}.tool_call_id")
        out["tool_call_id"] = call_id
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ApiError(400, f"{where}[{j}] must be an object with a 'type'", param=f"{where}[{j}]")
        if part["type"] != "text":
            raise ApiError(400, f"{where}[{j}] is a '{part['type'][:40]}' part; qkv serves a text model and "
                           "takes only 'text' parts", param=f"{where}[{j}].type")
        extra = set(part) - {"type", "text"}
        if extra:
            raise ApiError(400, f"{where}[{j}].{sorted(extra)[0]} is not supported", param=f"{where}[{j}]")
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ApiError(400, f"{where} must be a list", param=where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(function, dict)
                or not isinstance(function.get("name"), str) or not isinstance(call.get("id"), str)):
            raise ApiError(400, f"{at} must be {{'id': str, 'type': 'function', 'function': {{'name': str, "
                           "'arguments': str}}}", param=at)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise ApiError(400, f"{at}.function.arguments is not valid JSON", param=f"{at}.function.arguments") from None
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out
