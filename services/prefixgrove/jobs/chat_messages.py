"""A chat body's messages, as the model's chat template takes them: each its role and text, and for
tool calling (OpenAI's shapes) an assistant message's `tool_calls` and a tool message's
`tool_call_id` and `name`.

A tool call's `arguments` is a JSON string in OpenAI's API; chat templates (Hugging Face's
convention) print it as an object, so it is handed to them parsed, as vLLM hands it.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from prefixgrove.jobs.request_errors import InvalidRequest, shown

Message = dict[str, Any]


def body_messages(messages: Any) -> list[Message]:
    """A chat body's messages, each checked; ready for the chat template."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(
            "invalid_messages", f"messages must be a non-empty list, got {shown(messages)}"
        )
    return [_message(message, i) for i, message in enumerate(messages)]


def _message(message: Any, i: int) -> Message:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidRequest(
            "invalid_messages", f"messages[{i}] must be an object with a string role"
        )
    calls = message.get("tool_calls")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text is served
        content = _text_parts(content, i)
    if not isinstance(content, str) and not (content is None and calls):
        raise InvalidRequest(
            "invalid_messages",
            f"messages[{i}].content must be a string or a list of text parts (null only beside "
            f"tool_calls), got {shown(content)}",
        )
    out: Message = {"role": message["role"], "content": content}
    if calls:
        out["tool_calls"] = [_tool_call(call, i, j) for j, call in enumerate(_list(calls, i))]
    for name in ("tool_call_id", "name"):
        if message.get(name) is not None:
            if not isinstance(message[name], str):
                raise InvalidRequest(
                    "invalid_messages",
                    f"messages[{i}].{name} must be a string, got {shown(message[name])}",
                )
            out[name] = message[name]
    return out


def _list(calls: Any, i: int) -> list[Any]:
    if not isinstance(calls, list):
        raise InvalidRequest(
            "invalid_messages", f"messages[{i}].tool_calls must be a list, got {shown(calls)}"
        )
    return calls


def _tool_call(call: Any, i: int, j: int) -> dict[str, Any]:
    """An OpenAI tool call, its arguments parsed for the template (left a string if not JSON)."""
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name or not isinstance(arguments, (str, dict)):
        raise InvalidRequest(
            "invalid_messages",
            f"messages[{i}].tool_calls[{j}] must be {{'id', 'type': 'function', 'function': "
            f"{{'name', 'arguments'}}}}, got {shown(call)}",
        )
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # not JSON: the template gets the text
            arguments = json.loads(arguments)
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _text_parts(parts: list[Any], i: int) -> str:
    for j, part in enumerate(parts):
        if not (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            raise InvalidRequest(
                "invalid_messages",
                f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': <string>}} "
                f"(only text parts are served), got {shown(part)}",
            )
    return "".join(part["text"] for part in parts)
