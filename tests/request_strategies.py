"""Hypothesis strategies for hostile OpenAI Batch input: request lines whose every field may hold any
JSON value (huge and negative numbers, NaN, lone surrogates, NUL, right-to-left marks, deep nesting),
next to lines that are not JSON, not UTF-8 or not a line's worth of anything. Shared by the fuzz tests
of the request parser (jobs/) and of `prefixgrove run`.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

HOSTILE_INTS = [
    10**30, -(10**30), 2**63, 2**63 - 1, -(2**63) - 1, 2**64, 2**31, 2**31 - 1, -(2**31) - 1,
    -1, 0, 10**400,
]  # fmt: skip
HOSTILE_FLOATS = [float("nan"), float("inf"), float("-inf"), 1e308, -0.0, 5e-324]
HOSTILE_TEXT = [
    "\ud800", "\udfff", "a\udc00b", "\ud83d", "\x00", "a\x00b", "\u202e", "\u200f", "\ufeff", "",
    "\ud83d\ude00", " ", "\n", "\\", '"',
]  # fmt: skip

texts = st.text(st.characters(exclude_categories=()), max_size=12) | st.sampled_from(HOSTILE_TEXT)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(HOSTILE_INTS)
    | st.floats()
    | st.sampled_from(HOSTILE_FLOATS)
    | texts
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=10,
)


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


deep_values = st.integers(30, 400).map(
    _nested
)  # deeper than MAX_DEPTH; json.dumps can still write it


def mostly(usual: st.SearchStrategy[Any], rare: st.SearchStrategy[Any], one_in: int = 8):
    """`usual`, but one draw in about `one_in` from `rare`: so most lines get deep into validation."""
    return st.sampled_from([False] * (one_in - 1) + [True]).flatmap(lambda r: rare if r else usual)


any_value = mostly(json_values, deep_values, one_in=4)

_VALID: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.text(min_size=1, max_size=20) | st.lists(st.integers(0, 200), min_size=1, max_size=8),
    "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=20)}),
        min_size=1, max_size=2,
    ),
    "max_tokens": st.integers(1, 3),
    "max_completion_tokens": st.integers(1, 3),
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(-1, 2**31 - 1),
    "min_p": st.floats(0.0, 1.0),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.text(min_size=1, max_size=4),
    "stop_token_ids": st.lists(st.integers(0, 2**31 - 1), max_size=3),
    "logprobs": st.integers(0, 5),
    "top_logprobs": st.integers(0, 5),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.01, 10.0),
    "model": st.just("tiny-random-llama"),  # the served name: any other is model_not_found
    "n": st.integers(1, 3),
    "logit_bias": st.dictionaries(st.integers(0, 200).map(str), st.floats(-100.0, 100.0), max_size=3),
    "user": st.text(max_size=8),
    "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
    "store": st.booleans(),
    "service_tier": st.sampled_from(["auto", "default", "flex"]),
    "parallel_tool_calls": st.booleans(),
    "response_format": st.just({"type": "text"}),
}  # fmt: skip
URLS = ["/v1/completions", "/v1/chat/completions"]
_CHAT_ONLY = {
    "messages", "top_logprobs", "max_completion_tokens", "metadata", "store", "service_tier",
    "parallel_tool_calls", "response_format",
}  # fmt: skip
_OPTIONAL = {
    URLS[0]: sorted(set(_VALID) - _CHAT_ONLY - {"prompt"}),
    URLS[1]: sorted(set(_VALID) - {"prompt", "messages"}),
}


@st.composite
def bodies(draw: st.DrawFn, url: str) -> dict[str, Any]:
    """A body whose prompt is usually valid and whose other fields are valid, hostile or absent."""
    body: dict[str, Any] = {}
    main = "messages" if url.endswith("chat/completions") else "prompt"
    body[main] = draw(mostly(_VALID[main], any_value))
    for name in draw(st.lists(st.sampled_from(_OPTIONAL[url]), max_size=4, unique=True)):
        body[name] = draw(mostly(_VALID[name], any_value, one_in=4))
    body.setdefault("max_tokens", 2)  # keeps the end-to-end runs short
    return body


@st.composite
def request_objects(draw: st.DrawFn, custom_id: str) -> dict[str, Any]:
    """A request line's object: custom_id, url and body each valid or any JSON value."""
    url = draw(st.sampled_from(URLS))
    obj: dict[str, Any] = {
        "custom_id": draw(mostly(st.just(custom_id), any_value)),
        "method": draw(mostly(st.just("POST"), any_value)),
        "url": draw(mostly(st.just(url), any_value)),
        "body": draw(mostly(bodies(url), any_value)),
    }
    if draw(mostly(st.just(False), st.just(True), one_in=20)):
        obj[draw(texts)] = draw(any_value)
    return obj


def _dump(obj: Any) -> bytes:
    """JSON as the files hold it: lone surrogates as \\ud800 escapes; NaN as the bare word."""
    return json.dumps(obj).encode()


raw_lines = (
    st.binary(max_size=40)
    | st.integers(1, 5000).map(lambda n: b"[" * n)
    | texts.map(lambda t: t.encode("utf-8", "surrogatepass"))
    | st.builds(lambda obj, cut: _dump(obj)[:cut], request_objects("cut"), st.integers(0, 60))
)


def request_lines(custom_id: str) -> st.SearchStrategy[bytes]:
    """One input line, without its newline: mostly a request object, sometimes raw hostile bytes."""
    line = mostly(request_objects(custom_id).map(_dump), raw_lines, one_in=5)
    return line.map(lambda b: b.replace(b"\n", b" ").replace(b"\r", b" "))
