"""One OpenAI Batch request line -> a validated request, or a per-request error that names the fault.

Nothing here tokenizes: this is the cheap part that runs on every line as it arrives. A request that
passes holds only what the engine can store: integers within int32 (token ids, max_tokens, top_k,
stop_token_ids) or int64 (seed), finite floats, strings that are valid Unicode (no lone surrogates,
so they encode to UTF-8), and no nesting deeper than `MAX_DEPTH`. Whatever a line holds, it yields
one BatchRequest or one RequestError; nothing raises.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Literal

import numpy as np

from prefixgrove.jobs.output_lines import error_line

Endpoint = Literal["completions", "chat"]

URLS: dict[str, Endpoint] = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_LINE_FIELDS = {"custom_id", "method", "url", "body"}
# Output constraints: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
_STRUCTURED_FIELDS = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar",
)  # fmt: skip
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_COMMON_BODY_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "logprobs", "ignore_eos", "n", "stream", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop_token_ids", "logit_bias", "user", "stream_options",
    *_STRUCTURED_FIELDS,
}  # fmt: skip
# Documented OpenAI fields that change nothing in an offline batch: accepted and ignored.
_IGNORED_CHAT_FIELDS = {
    "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
    "safety_identifier",
}  # fmt: skip
# Documented OpenAI fields whose feature is not served: a request setting one fails, naming it.
_UNSERVED_FIELDS: dict[Endpoint, dict[str, str]] = {
    "completions": {"suffix": "insertion (suffix)"},
    "chat": {
        "tools": "tool calling", "tool_choice": "tool calling", "functions": "function calling",
        "function_call": "function calling", "audio": "audio output",
        "prediction": "predicted outputs", "web_search_options": "web search",
        "reasoning_effort": "reasoning models", "verbosity": "reasoning models",
    },
}  # fmt: skip
_BODY_FIELDS: dict[Endpoint, set[str]] = {
    "completions": _COMMON_BODY_FIELDS | set(_UNSERVED_FIELDS["completions"])
    | {"prompt", "echo", "best_of"},
    "chat": _COMMON_BODY_FIELDS | _IGNORED_CHAT_FIELDS | set(_UNSERVED_FIELDS["chat"])
    | {"messages", "top_logprobs", "max_completion_tokens", "modalities"},
}  # fmt: skip
_MAX_STOP_STRINGS = 16
_MAX_LOGPROBS = 20
_MAX_N = 128  # OpenAI's own bound on samples per request
INT32_MAX = 2**31 - 1
MAX_DEPTH = 32  # arrays and objects inside one another; a valid request needs 5
# A lone surrogate can only come from a \uD800-\uDFFF escape: raw UTF-8 holds none.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?')  # an unterminated one runs to the end
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_SURROGATE = re.compile("[\ud800-\udfff]")  # a str holding one cannot be written as UTF-8


@dataclass(frozen=True, slots=True)
class RequestError:
    """A request that will not run; it becomes one line of the job's error file."""

    index: int
    custom_id: str | None
    code: str
    message: str

    def to_line(self) -> str:
        line = error_line(self.index, self.custom_id, self.code, self.message)
        # A message quoting a tokenizer's or template's words may hold what UTF-8 cannot.
        if _is_unicode(line):
            return line
        return json.dumps(json.loads(line) | {"custom_id": None})


@dataclass(slots=True)
class BatchRequest:
    """A valid request line. Exactly one of prompt_text, prompt_token_ids, messages is set."""

    index: int
    custom_id: str
    endpoint: Endpoint
    params: dict[str, Any]  # keyword arguments of SamplingParams, JSON-serialisable
    prompt_text: str | None = None
    prompt_token_ids: np.ndarray | None = None  # int64
    messages: list[dict[str, str]] | None = field(default=None)
    model: str | None = None  # the body's model, which the response names


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
                "line_too_large", f"line is longer than the limit of {max_line_bytes} bytes"
            )
        text = _text(line)
        if text.count("[") + text.count("{") > MAX_DEPTH and _nesting(text) > MAX_DEPTH:
            raise _Invalid(
                "nesting_too_deep",
                f"line nests arrays and objects too deeply; at most {MAX_DEPTH} levels are "
                "accepted",
            )
        obj = _load(text)
        cid = obj.get("custom_id")
        custom_id = cid if isinstance(cid, str) and _is_unicode(cid) else None
        if _SURROGATE_ESCAPE.search(text) or text.count("[") + text.count("{") > MAX_DEPTH:
            _check_tree(obj)
        return _parse_object(obj, index, default_max_tokens)
    except _Invalid as exc:
        return RequestError(index, custom_id, exc.code, str(exc))


def _text(line: bytes | str) -> str:
    if isinstance(line, str):
        if not _is_unicode(line):
            raise _Invalid("invalid_encoding", "line holds a lone surrogate: it is not UTF-8 text")
        return line
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Invalid(
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
        raise _Invalid(
            "nesting_too_deep",
            f"line nests arrays and objects too deeply to parse; at most {MAX_DEPTH} levels "
            "are accepted",
        ) from None
    except ValueError as exc:
        raise _Invalid("invalid_json", f"line is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _Invalid("invalid_json", f"line must be a JSON object, got {type(obj).__name__}")
    return obj


def _check_tree(obj: Any) -> None:
    """Refuses nesting deeper than MAX_DEPTH and strings (keys too) holding lone surrogates,
    naming where; iterative, so no depth can exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(obj, "line", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _Invalid(
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
    found = _SURROGATE.search(text)
    if found is not None:
        at = found.start()
        raise _Invalid(
            "invalid_value",
            f"{path} holds a lone surrogate {text[at]!r} at position {at} in {_short(text)}; "
            "strings must be valid Unicode (surrogates only in pairs)",
        )


def _is_unicode(text: str) -> bool:
    return _SURROGATE.search(text) is None


def _parse_object(obj: dict[str, Any], index: int, default_max_tokens: int) -> BatchRequest:
    unknown = sorted(set(obj) - _LINE_FIELDS)
    if unknown:
        raise _Invalid(
            "unknown_field", f"unknown field(s) {unknown}; accepted: {sorted(_LINE_FIELDS)}"
        )
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _Invalid(
            "missing_custom_id", f"custom_id must be a non-empty string, got {_short(custom_id)}"
        )
    if obj.get("method", "POST") != "POST":
        raise _Invalid("invalid_method", f"method must be 'POST', got {_short(obj.get('method'))}")
    url = obj.get("url")
    if not isinstance(url, str) or url not in URLS:
        raise _Invalid("invalid_url", f"url {_short(url)} is not served; accepted: {sorted(URLS)}")
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
    request.model = _model(body.get("model"))
    if endpoint == "completions":
        _set_prompt(request, body.get("prompt"))
    else:
        request.messages = _messages(body.get("messages"))
    return request


def _model(model: Any) -> str | None:
    if model is None or (isinstance(model, str) and model):
        return model
    raise _Invalid("invalid_value", f"model must be a non-empty string, got {_short(model)}")


def _set_prompt(request: BatchRequest, prompt: Any) -> None:
    # A one-element list is how the OpenAI API spells a single prompt too.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        request.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and _all_ints(prompt):
        request.prompt_token_ids = _token_ids(prompt)
    else:
        raise _Invalid(
            "invalid_prompt",
            f"prompt must be a non-empty string or a non-empty list of token ids, got {_short(prompt)}",
        )


def _all_ints(values: list[Any]) -> bool:
    """Whether every value is an integer (JSON's `true` is not). One pass in C: a job of token-id
    prompts holds millions of them, and checking each in Python took most of its upload."""
    return set(map(type, values)) == {int}


def _token_ids(prompt: list[int]) -> np.ndarray:
    """The prompt as int64, once its ids are known to fit in int32 (checked in numpy)."""
    try:
        ids = np.array(prompt, dtype=np.int64)
        if ids.min() >= -INT32_MAX and ids.max() <= INT32_MAX:
            return ids
    except OverflowError:  # beyond int64: found below, by position
        pass
    i, token = next((i, t) for i, t in enumerate(prompt) if not -INT32_MAX <= t <= INT32_MAX)
    raise _Invalid(
        "invalid_token_id",
        f"prompt token {_short(token)} at position {i} is not a token id: ids are "
        f"integers in [0, {INT32_MAX}] (and below the model's vocabulary size)",
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
            content = _text_parts(content, i)
        if not isinstance(content, str):
            raise _Invalid(
                "invalid_messages",
                f"messages[{i}].content must be a string or a list of text parts, "
                f"got {_short(content)}",
            )
        out.append({"role": message["role"], "content": content})
    return out


def _text_parts(parts: list[Any], i: int) -> str:
    for j, part in enumerate(parts):
        if not (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            raise _Invalid(
                "invalid_messages",
                f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': <string>}} "
                f"(only text parts are served), got {_short(part)}",
            )
    return "".join(part["text"] for part in parts)


def _sampling(body: dict[str, Any], endpoint: Endpoint, default_max_tokens: int) -> dict[str, Any]:
    _check_unserved(body, endpoint)
    n = _samples(body)
    if body.get("stream", False) is not False:
        raise _Invalid(
            "invalid_value", f"stream must be false in a batch, got {_short(body['stream'])}"
        )
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(name)
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    params: dict[str, Any] = {"max_tokens": _int(max_tokens, name, 1, INT32_MAX)}
    if n > 1:
        params["n"] = n
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
        params["top_k"] = max(_int(body["top_k"], "top_k", -1, INT32_MAX), 0)
    if body.get("seed") is not None:
        params["seed"] = _int(body["seed"], "seed", 0, 2**63 - 1)
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise _Invalid(
                "invalid_value",
                f"ignore_eos must be a boolean, got {_short(body['ignore_eos'])}",
            )
        params["ignore_eos"] = body["ignore_eos"]
    if body.get("stop") is not None:
        params["stop"] = _stop(body["stop"])
    if body.get("stop_token_ids") is not None:
        params["stop_token_ids"] = _stop_token_ids(body["stop_token_ids"])
    logprobs = _logprobs(body, endpoint)
    if logprobs is not None:
        params["logprobs"] = logprobs
    if body.get("logit_bias") is not None:
        params["logit_bias"] = _logit_bias(body["logit_bias"])
    structured = _structured(body)
    if structured is not None:
        params["structured_outputs"] = structured
    return params


def _check_unserved(body: dict[str, Any], endpoint: Endpoint) -> None:
    """Fails a request that asks for a documented feature this server does not provide."""
    for name, feature in _UNSERVED_FIELDS[endpoint].items():
        if body.get(name) is not None:
            raise _Invalid(
                "unsupported_field",
                f"{name} is not supported: {feature} is not served; remove {name} from the body",
            )
    if body.get("echo", False) is not False:
        raise _Invalid("unsupported_field", "echo is not supported: only false is accepted")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise _Invalid(
            "unsupported_field",
            f"modalities {_short(modalities)} is not supported: only ['text'] is served",
        )


def _structured(body: dict[str, Any]) -> dict[str, Any] | None:
    """The request's output constraint as StructuredOutputsParams keyword arguments, from OpenAI's
    `response_format` (json_object, json_schema) or vLLM's `structured_outputs` object and
    `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields; at most one of
    them. Whether a schema, regex or grammar compiles is the engine's check (a per-request error)."""
    given = {name: body[name] for name in _STRUCTURED_FIELDS if body.get(name) is not None}
    response_format = given.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "text":
        del given["response_format"]
    if len(given) > 1:
        raise _Invalid(
            "invalid_value",
            f"{' and '.join(sorted(given))} both constrain the output: give at most one",
        )
    if not given:
        return None
    ((name, value),) = given.items()
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    kind = name.removeprefix("guided_")
    return _structured_outputs({kind: value})


def _response_format(response_format: Any) -> dict[str, Any]:
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _Invalid(
                "invalid_value",
                "response_format.json_schema must be an object with a `schema` object (and a "
                f"`name`), got {_short(spec)}",
            )
        return {"json": schema}
    raise _Invalid(
        "invalid_value",
        f"response_format must be an object with a type of 'text', 'json_object' or "
        f"'json_schema', got {_short(response_format)}",
    )


def _structured_outputs(spec: Any) -> dict[str, Any]:
    """vLLM's structured_outputs object: exactly one of json, regex, choice, grammar, json_object."""
    kinds = [k for k in _STRUCTURED_KINDS if isinstance(spec, dict) and spec.get(k) is not None]
    known = {*_STRUCTURED_KINDS, "disable_any_whitespace"}
    unknown = sorted(set(spec) - known) if isinstance(spec, dict) else []
    if not isinstance(spec, dict) or len(kinds) != 1 or unknown:
        raise _Invalid(
            "invalid_value",
            "structured_outputs must be an object with exactly one of "
            f"{', '.join(_STRUCTURED_KINDS)}, got {_short(spec)}",
        )
    kind = kinds[0]
    value = spec[kind]
    checks = {
        "json": isinstance(value, (dict, str)) and bool(value),
        "regex": isinstance(value, str) and bool(value),
        "grammar": isinstance(value, str) and bool(value),
        "choice": isinstance(value, list)
        and bool(value)
        and all(isinstance(c, str) for c in value),
        "json_object": value is True,
    }
    if not checks[kind]:
        expected = {
            "json": "a JSON schema (an object, or a string holding one)",
            "regex": "a regular expression (a non-empty string)",
            "grammar": "an EBNF / GBNF grammar (a non-empty string)",
            "choice": "a non-empty list of strings",
            "json_object": "true",
        }[kind]
        raise _Invalid("invalid_value", f"{kind} must be {expected}, got {_short(value)}")
    compact = spec.get("disable_any_whitespace", False)
    if not isinstance(compact, bool):
        raise _Invalid(
            "invalid_value",
            f"structured_outputs.disable_any_whitespace must be a boolean, got {_short(compact)}",
        )
    return {kind: value, "disable_any_whitespace": True} if compact else {kind: value}


def _samples(body: dict[str, Any]) -> int:
    """n, OpenAI's samples per request (each a choice of the response, `index` 0..n-1; seeded
    sample j uses seed + j, as vLLM's). best_of may only repeat n: every sample is returned."""
    n = _int(body["n"], "n", 1, _MAX_N) if body.get("n") is not None else 1
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise _Invalid(
            "unsupported_field",
            f"best_of {_short(best_of)} is not supported: every sample is returned, so best_of "
            f"may only equal n ({n})",
        )
    return n


def _logit_bias(bias: Any) -> dict[str, float]:
    """OpenAI's map of token id (a decimal string, as JSON keys are) -> bias in [-100, 100]. The
    keys stay strings so the params survive JSON; `sampling_kwargs` turns them into ids."""
    if not isinstance(bias, dict):
        raise _Invalid(
            "invalid_value",
            f"logit_bias must be an object of token id -> number in [-100, 100], got {_short(bias)}",
        )
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= INT32_MAX):
            raise _Invalid(
                "invalid_value",
                f"logit_bias key {_short(key)} is not a token id: keys are integers in "
                f"[0, {INT32_MAX}] written as strings",
            )
        _float(value, f"logit_bias[{key!r}]", -100.0, 100.0)
    return {key: float(value) for key, value in bias.items()}


def sampling_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """A request's params -> SamplingParams keyword arguments (logit_bias keyed by token id)."""
    if "logit_bias" not in params:
        return params
    return {**params, "logit_bias": {int(k): v for k, v in params["logit_bias"].items()}}


def _stop_token_ids(ids: Any) -> list[int]:
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
        raise _Invalid(
            "invalid_value",
            f"stop_token_ids must be a list of token ids (integers in [0, {INT32_MAX}]), "
            f"got {_short(ids)}",
        )
    return ids


def _logprobs(body: dict[str, Any], endpoint: Endpoint) -> int | None:
    value = body.get("logprobs")
    if endpoint == "completions":
        return None if value is None else _int(value, "logprobs", 0, _MAX_LOGPROBS)
    if value is None or value is False:
        return None
    if value is not True:
        raise _Invalid("invalid_value", f"logprobs must be a boolean for chat, got {_short(value)}")
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
            f"stop must be a string or a list of at most {_MAX_STOP_STRINGS} non-empty "
            f"strings, got {_short(stop)}",
        )
    return stops


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value: Any, name: str, low: int, high: int | None = None) -> int:
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _Invalid("invalid_value", f"{name} must be an integer {bound}, got {_short(value)}")
    return int(value)


def _float(value: Any, name: str, low: float, high: float) -> float:
    # NOTE: compare before converting: an integer of 400 digits has no float.
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not low <= value <= high or not math.isfinite(value):
        raise _Invalid(
            "invalid_value", f"{name} must be a number in [{low}, {high}], got {_short(value)}"
        )
    return float(value)


def _short(value: Any) -> str:
    if _is_int(value) and value.bit_length() > 128:  # whole, it could be 4,000 digits
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def engine_error(index: int, custom_id: str, exc: ValueError) -> RequestError:
    """What the engine refuses after the planner accepted (its own context and cache limits)."""
    text = str(exc)
    code = "context_length_exceeded" if "max_model_len" in text else "invalid_request"
    return RequestError(index, custom_id, code, text)
