"""One OpenAI Batch request line -> a validated request, or a per-request error that names the fault.

Nothing here tokenizes: this is the cheap part that runs on every line as it arrives.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

Endpoint = Literal["completions", "chat"]

URLS: dict[str, Endpoint] = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_LINE_FIELDS = {"custom_id", "method", "url", "body"}
_COMMON_BODY_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "logprobs", "ignore_eos", "n", "stream", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop_token_ids",
}  # fmt: skip
_BODY_FIELDS: dict[Endpoint, set[str]] = {
    "completions": _COMMON_BODY_FIELDS | {"prompt"},
    "chat": _COMMON_BODY_FIELDS | {"messages", "top_logprobs", "max_completion_tokens"},
}
_MAX_STOP_STRINGS = 16
_MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class RequestError:
    """A request that will not run; it becomes one line of the job's error file."""

    index: int
    custom_id: str | None
    code: str
    message: str

    def to_line(self) -> str:
        error = {"code": self.code, "message": self.message}
        return json.dumps({"custom_id": self.custom_id, "error": error}, ensure_ascii=False)


@dataclass(slots=True)
class BatchRequest:
    """A valid request line. Exactly one of prompt_text, prompt_token_ids, messages is set."""

    index: int
    custom_id: str
    endpoint: Endpoint
    params: dict[str, Any]  # keyword arguments of SamplingParams, JSON-serialisable
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = field(default=None)


class _Invalid(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_line(
    line: bytes | str, index: int, *, max_line_bytes: int, default_max_tokens: int
) -> BatchRequest | RequestError:
    """Validates one JSONL line; never raises for bad input."""
    custom_id: str | None = None
    try:
        if len(line) > max_line_bytes:
            raise _Invalid(
                "line_too_large", f"line is {len(line)} bytes; the limit is {max_line_bytes}"
            )
        obj = _load(line)
        cid = obj.get("custom_id")
        custom_id = cid if isinstance(cid, str) else None
        return _parse_object(obj, index, default_max_tokens)
    except _Invalid as exc:
        return RequestError(index, custom_id, exc.code, str(exc))


def _load(line: bytes | str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _Invalid("invalid_json", f"line is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _Invalid("invalid_json", f"line must be a JSON object, got {type(obj).__name__}")
    return obj


def _parse_object(obj: dict[str, Any], index: int, default_max_tokens: int) -> BatchRequest:
    unknown = sorted(set(obj) - _LINE_FIELDS)
    if unknown:
        raise _Invalid(
            "unknown_field", f"unknown field(s) {unknown}; accepted: {sorted(_LINE_FIELDS)}"
        )
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _Invalid(
            "missing_custom_id", f"custom_id must be a non-empty string, got {custom_id!r}"
        )
    if obj.get("method", "POST") != "POST":
        raise _Invalid("invalid_method", f"method must be 'POST', got {obj.get('method')!r}")
    url = obj.get("url")
    if url not in URLS:
        raise _Invalid("invalid_url", f"url {url!r} is not served; accepted: {sorted(URLS)}")
    endpoint = URLS[url]
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _Invalid("invalid_body", f"body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _BODY_FIELDS[endpoint])
    if unknown:
        raise _Invalid(
            "unknown_field",
            f"unknown body field(s) {unknown} for {url}; accepted: {sorted(_BODY_FIELDS[endpoint])}",
        )
    request = BatchRequest(
        index, custom_id, endpoint, _sampling(body, endpoint, default_max_tokens)
    )
    if endpoint == "completions":
        _set_prompt(request, body.get("prompt"))
    else:
        request.messages = _messages(body.get("messages"))
    return request


def _set_prompt(request: BatchRequest, prompt: Any) -> None:
    # A one-element list is how the OpenAI API spells a single prompt too.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        request.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        request.prompt_token_ids = [int(t) for t in prompt]
    else:
        raise _Invalid(
            "invalid_prompt",
            f"prompt must be a non-empty string or a non-empty list of token ids, got {_short(prompt)}",
        )


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise _Invalid(
            "invalid_messages", f"messages must be a non-empty list, got {_short(messages)}"
        )
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _Invalid(
                "invalid_messages", f"messages[{i}] must be an object with a string role"
            )
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text is served
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise _Invalid(
                    "invalid_messages", f"messages[{i}].content: only text parts are served"
                )
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise _Invalid("invalid_messages", f"messages[{i}].content must be a string")
        out.append({"role": message["role"], "content": content})
    return out


def _sampling(body: dict[str, Any], endpoint: Endpoint, default_max_tokens: int) -> dict[str, Any]:
    if body.get("n", 1) != 1:
        raise _Invalid("invalid_value", f"n must be 1, got {body.get('n')!r}")
    if body.get("stream", False) is not False:
        raise _Invalid("invalid_value", "stream must be false in a batch")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    params: dict[str, Any] = {"max_tokens": _int(max_tokens, "max_tokens", 1)}
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0)):
        if body.get(name) is not None:
            params[name] = _float(body[name], name, low, high)
    if "top_p" in params and params["top_p"] == 0.0:
        raise _Invalid("invalid_value", "top_p must be > 0")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            params[name] = _float(body[name], name, -2.0, 2.0)
    if body.get("repetition_penalty") is not None:
        params["repetition_penalty"] = _float(
            body["repetition_penalty"], "repetition_penalty", 0.01, 10.0
        )
    if body.get("top_k") is not None:
        params["top_k"] = max(_int(body["top_k"], "top_k", -1), 0)
    if body.get("seed") is not None:
        params["seed"] = _int(body["seed"], "seed", 0, 2**63 - 1)
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise _Invalid(
                "invalid_value", f"ignore_eos must be a boolean, got {body['ignore_eos']!r}"
            )
        params["ignore_eos"] = body["ignore_eos"]
    if body.get("stop") is not None:
        params["stop"] = _stop(body["stop"])
    if body.get("stop_token_ids") is not None:
        ids = body["stop_token_ids"]
        if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
            raise _Invalid("invalid_value", "stop_token_ids must be a list of token ids")
        params["stop_token_ids"] = ids
    logprobs = _logprobs(body, endpoint)
    if logprobs is not None:
        params["logprobs"] = logprobs
    return params


def _logprobs(body: dict[str, Any], endpoint: Endpoint) -> int | None:
    value = body.get("logprobs")
    if endpoint == "completions":
        return None if value is None else _int(value, "logprobs", 0, _MAX_LOGPROBS)
    if value is None or value is False:
        return None
    if value is not True:
        raise _Invalid("invalid_value", f"logprobs must be a boolean for chat, got {value!r}")
    top = body.get("top_logprobs")
    return 0 if top is None else _int(top, "top_logprobs", 0, _MAX_LOGPROBS)


def _stop(stop: Any) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > _MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise _Invalid(
            "invalid_value",
            f"stop must be a string or a list of at most {_MAX_STOP_STRINGS} non-empty strings",
        )
    return stops


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value: Any, name: str, low: int, high: int | None = None) -> int:
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _Invalid("invalid_value", f"{name} must be an integer {bound}, got {value!r}")
    return int(value)


def _float(value: Any, name: str, low: float, high: float) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not low <= value <= high:
        raise _Invalid(
            "invalid_value", f"{name} must be a number in [{low}, {high}], got {value!r}"
        )
    return float(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def engine_error(index: int, custom_id: str, exc: ValueError) -> RequestError:
    """What the engine refuses after the planner accepted (its own context and cache limits)."""
    text = str(exc)
    code = "context_length_exceeded" if "max_model_len" in text else "invalid_request"
    return RequestError(index, custom_id, code, text)
