"""A line's text before its fields are read: its size, its encoding, how deep it nests, whether it
is a JSON object, and whether every string in it is valid Unicode."""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

from prefixgrove.jobs.request_errors import SURROGATE, InvalidRequest, is_unicode, shown

MAX_DEPTH = 32  # arrays and objects inside one another; a valid request needs 5
# A lone surrogate can only come from a \uD800-\uDFFF escape: raw UTF-8 holds none.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?')  # an unterminated one runs to the end
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def load_line(line: bytes | str, max_line_bytes: int) -> tuple[str, dict[str, Any]]:
    """The line's text and the JSON object it holds, once its size, encoding and nesting pass."""
    if len(line) > max_line_bytes:
        raise InvalidRequest(
            "line_too_large", f"line is longer than the limit of {max_line_bytes} bytes"
        )
    text = _text(line)
    if text.count("[") + text.count("{") > MAX_DEPTH and _nesting(text) > MAX_DEPTH:
        raise InvalidRequest(
            "nesting_too_deep",
            f"line nests arrays and objects too deeply; at most {MAX_DEPTH} levels are accepted",
        )
    return text, _load(text)


def check_values(text: str, obj: dict[str, Any]) -> None:
    """Refuses a loaded line nesting deeper than MAX_DEPTH or holding a lone surrogate; walks the
    object only where its text shows it may."""
    if _SURROGATE_ESCAPE.search(text) or text.count("[") + text.count("{") > MAX_DEPTH:
        _check_tree(obj)


def _text(line: bytes | str) -> str:
    if isinstance(line, str):
        if not is_unicode(line):
            raise InvalidRequest(
                "invalid_encoding", "line holds a lone surrogate: it is not UTF-8 text"
            )
        return line
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(
            "invalid_encoding",
            f"line is not UTF-8: byte 0x{line[exc.start]:02x} at offset {exc.start} "
            f"({exc.reason}); the input must be UTF-8 text",
        ) from None


def _nesting(text: str) -> int:
    """How deep the line's arrays and objects nest, strings aside (whether it is valid JSON or
    not). Measured before parsing: how deep json.loads gets before it raises RecursionError
    depends on the caller's stack, so a line's error would depend on where it was parsed."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(accumulate(1 if c in "[{" else -1 for c in brackets), default=0)


def _load(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except RecursionError:
        raise InvalidRequest(
            "nesting_too_deep",
            f"line nests arrays and objects too deeply to parse; at most {MAX_DEPTH} levels "
            "are accepted",
        ) from None
    except ValueError as exc:
        raise InvalidRequest("invalid_json", f"line is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise InvalidRequest(
            "invalid_json", f"line must be a JSON object, got {type(obj).__name__}"
        )
    return obj


def _check_tree(obj: Any) -> None:
    """Refuses nesting deeper than MAX_DEPTH and strings (keys too) holding lone surrogates,
    naming where; iterative, so no depth can exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(obj, "line", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise InvalidRequest(
                "nesting_too_deep",
                f"{path} is nested {depth} levels deep; at most {MAX_DEPTH} are accepted",
            )
        if isinstance(value, str):
            _check_unicode(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_unicode(key, f"{path} key")
                stack.append((item, f"{path}.{key}" if path != "line" else key, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_unicode(text: str, path: str) -> None:
    found = SURROGATE.search(text)
    if found is not None:
        at = found.start()
        raise InvalidRequest(
            "invalid_value",
            f"{path} holds a lone surrogate {text[at]!r} at position {at} in {shown(text)}; "
            "strings must be valid Unicode (surrogates only in pairs)",
        )
