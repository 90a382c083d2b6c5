"""One OpenAI Batch request line -> a validated request, or a per-request error that names the fault.

Nothing here tokenizes: this is the cheap part that runs on every line as it arrives. A request that
passes holds only what the engine can store: integers within int32 (token ids, max_tokens, top_k,
stop_token_ids) or int64 (seed), finite floats, strings that are valid Unicode (no lone surrogates,
so they encode to UTF-8), and no nesting deeper than `MAX_DEPTH`. Whatever a line holds, it yields
one BatchRequest or one RequestError; nothing raises.

The checks, in the order a line meets them: request_line.py (size, encoding, nesting, JSON,
Unicode), the envelope here (custom_id, method, url), request_body.py (the endpoint's fields, the
prompt or messages), sampling_fields.py and structured_fields.py (what shapes the output); the
errors and their codes are request_errors.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prefixgrove.jobs.chat_messages import Message, body_messages
from prefixgrove.jobs.embedding_fields import MAX_INPUTS, embedding_params
from prefixgrove.jobs.request_body import URLS, Endpoint, body_model, body_prompt, check_body_fields
from prefixgrove.jobs.request_errors import InvalidRequest, RequestError, is_unicode, shown
from prefixgrove.jobs.request_line import check_values, load_line
from prefixgrove.jobs.sampling_fields import sampling_params
from prefixgrove.jobs.tool_fields import tool_request
from prefixgrove.jobs.vllm_fields import ChatOptions, chat_options

_LINE_FIELDS = {"custom_id", "method", "url", "body"}


@dataclass(slots=True)
class BatchRequest:
    """A valid request line. Exactly one of prompt_text, prompt_token_ids, prompt_parts (a
    completions line of several prompts: prompt_parts.py), messages is set."""

    index: int
    custom_id: str
    endpoint: Endpoint
    params: dict[str, Any]  # keyword arguments of SamplingParams, JSON-serialisable
    prompt_text: str | None = None
    prompt_token_ids: np.ndarray | None = None  # int64
    messages: list[Message] | None = field(default=None)
    model: str | None = None  # the body's model, which the response names
    chat_options: ChatOptions | None = None  # how a chat's template renders it
    prompt_parts: list[str] | list[np.ndarray] | None = None
    tools: list[dict[str, Any]] | None = None  # a chat's tools, which its template renders


def parse_line(
    line: bytes | str, index: int, *, max_line_bytes: int, default_max_tokens: int
) -> BatchRequest | RequestError:
    """Validates one JSONL line; never raises for bad input."""
    custom_id: str | None = None
    try:
        text, obj = load_line(line, max_line_bytes)
        cid = obj.get("custom_id")
        custom_id = cid if isinstance(cid, str) and is_unicode(cid) else None
        check_values(text, obj)
        return _parse_object(obj, index, default_max_tokens)
    except InvalidRequest as exc:
        return RequestError(index, custom_id, exc.code, str(exc))


def _parse_object(obj: dict[str, Any], index: int, default_max_tokens: int) -> BatchRequest:
    unknown = sorted(set(obj) - _LINE_FIELDS)
    if unknown:
        raise InvalidRequest(
            "unknown_field", f"unknown field(s) {unknown}; accepted: {sorted(_LINE_FIELDS)}"
        )
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidRequest(
            "missing_custom_id", f"custom_id must be a non-empty string, got {shown(custom_id)}"
        )
    if obj.get("method", "POST") != "POST":
        raise InvalidRequest(
            "invalid_method", f"method must be 'POST', got {shown(obj.get('method'))}"
        )
    url = obj.get("url")
    if not isinstance(url, str) or url not in URLS:
        raise InvalidRequest(
            "invalid_url", f"url {shown(url)} is not served; accepted: {sorted(URLS)}"
        )
    endpoint = URLS[url]
    body = obj.get("body")
    if not isinstance(body, dict):
        raise InvalidRequest(
            "invalid_body", f"body must be a JSON object, got {type(body).__name__}"
        )
    check_body_fields(body, endpoint, url)
    if endpoint == "embeddings":
        params = embedding_params(body)
    else:
        params = sampling_params(body, endpoint, default_max_tokens)
    request = BatchRequest(index, custom_id, endpoint, params)
    request.model = body_model(body.get("model"))
    if endpoint == "chat":
        request.messages = body_messages(body.get("messages"))
        request.chat_options = chat_options(body)
        request.tools = tool_request(body, request.params)
        return request
    if endpoint == "embeddings":
        prompt = body_prompt(body.get("input"), MAX_INPUTS, "input")
    else:
        prompt = body_prompt(body.get("prompt"))
    if isinstance(prompt, str):
        request.prompt_text = prompt
    elif isinstance(prompt, list):
        if "prompt_logprobs" in request.params:
            raise InvalidRequest(
                "unsupported_field",
                "prompt_logprobs with several prompts is not supported: give each prompt a line "
                "of its own",
            )
        request.prompt_parts = prompt
    else:
        request.prompt_token_ids = prompt
    return request
