"""Body fields a whole job gives each of its requests where the request does not set them (a
BatchJob's `spec.sampling`, a Parquet input's sampling JSON), applied by whoever reads the lines."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def with_body_defaults(raw: bytes, defaults: Mapping[str, Any]) -> bytes:
    """The request line with `defaults` set in its body where it has no value of its own; a line
    that is not a request object goes as it came (the planner reports it as a per-request error).
    `logprobs` is an integer: a completions body takes it as it is, a chat body as
    `logprobs: true` with that many `top_logprobs`; `max_tokens` yields to a body's
    `max_completion_tokens`."""
    if not defaults:
        return raw
    try:
        request = json.loads(raw)
    except ValueError:
        return raw
    body = request.get("body") if isinstance(request, dict) else None
    if not isinstance(body, dict):
        return raw
    chat = str(request.get("url", "")).endswith("/chat/completions")
    for name, value in defaults.items():
        if name == "logprobs":
            _set_logprobs(body, value, chat)
        elif name == "max_tokens" and "max_completion_tokens" in body:
            continue
        else:
            body.setdefault(name, value)
    return json.dumps(request, separators=(",", ":")).encode()


def _set_logprobs(body: dict[str, Any], count: int, chat: bool) -> None:
    if not chat:
        body.setdefault("logprobs", count)
    elif "logprobs" not in body and "top_logprobs" not in body:
        body["logprobs"] = True
        body["top_logprobs"] = count
