"""A chat reply as vLLM's server gives it: a reasoning model's thinking in `reasoning_content`, tool
calls parsed into `tool_calls`, in the format of the model's chat template (`tool_format`):

- "hermes" (Hermes, Qwen 2.5 / 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
  block per call; the text before the first block is the content;
- "mistral": `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`; the text before is the
  content; call ids are 9 letters and digits, as Mistral's templates require;
- "llama3_json" (Llama 3.1 / 3.2 / 3.3): the reply is a JSON object `{"name": ..., "parameters":
  {...}}` (after `<|python_tag|>`, or alone), several separated by "; "; there is no content.

A reply that does not parse as its format says is content, with no calls (vLLM's rule). Thinking
(`reasoning`): a reply `<think>...</think>answer` gives reasoning and content; one with no
`</think>` is all content. Calls of `tool_choice` "required" are parsed from the JSON array the
constraint held the reply to, a named function's from its arguments; both, like "auto" calls,
end the reply with finish_reason "tool_calls" (a named one: "stop", as OpenAI reports it).
Call ids derive from the request's id, so every path writes the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from typing import Any

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_ALNUM = string.ascii_letters + string.digits
_DECODER = json.JSONDecoder()


def tool_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, if one parsed here."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "Environment: ipython" in template:
        return "llama3_json"
    return None


def thinks(chat_template: str | None) -> bool:
    """Whether the chat template's model thinks in `<think>` blocks (Qwen3, DeepSeek-R1)."""
    return "<think>" in (chat_template or "")


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a reply that may open with a `<think>` block."""
    if "</think>" not in text:
        return None, text or None
    reasoning, _, content = text.partition("</think>")
    return reasoning.removeprefix("<think>").strip("\n") or None, content.lstrip("\n") or None


def parse_calls(text: str, form: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    """(content, [(name, arguments as JSON text)]) of a reply in `form`, or None when it holds
    no call that parses."""
    try:
        if form == "hermes":
            return _hermes(text)
        if form == "mistral":
            return _mistral(text)
        return _llama3_json(text)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _hermes(text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    blocks = [a or b for a, b in _HERMES.findall(text)]
    if not blocks:
        return None
    calls = [json.loads(block.strip()) for block in blocks]
    content = text[: text.index("<tool_call>")]
    return content or None, [(c["name"], _arguments(c.get("arguments", {}))) for c in calls]


def _mistral(text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    if "[TOOL_CALLS]" not in text:
        return None
    content, _, rest = text.partition("[TOOL_CALLS]")
    calls = json.loads(rest.replace("[TOOL_CALLS]", "").strip())
    calls = calls if isinstance(calls, list) else [calls]
    return content or None, [(c["name"], _arguments(c.get("arguments", {}))) for c in calls]


def _llama3_json(text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    rest = text.removeprefix("<|python_tag|>").strip()
    if not rest.startswith("{"):
        return None
    calls = []
    while rest:
        call, end = _DECODER.raw_decode(rest)
        calls.append((call["name"], _arguments(call.get("arguments", call.get("parameters", {})))))
        rest = rest[end:].lstrip().removeprefix(";").lstrip()
    return None, calls


def forced_calls(text: str, choice: Any) -> list[tuple[str, str]] | None:
    """The calls of a reply tool_choice held to: "required"'s JSON array, a named function's
    arguments; None where the reply does not parse (cut short by max_tokens)."""
    if isinstance(choice, dict):
        return [(choice["name"], text)]
    try:
        calls = json.loads(text)
        return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
    except (ValueError, TypeError, KeyError):
        return None


def call_id(seed: str, index: int, form: str | None) -> str:
    """A call's id, from its reply's: 9 letters and digits for Mistral, else vLLM's form."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=16).digest()
    if form == "mistral":
        return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])
    return f"chatcmpl-tool-{digest.hex()}"


def assistant_reply(
    text: str,
    token_ids: list[int],
    finish: str,
    params: dict[str, Any],
    tokenizer: Any,
    seed: str,
) -> tuple[dict[str, Any], str]:
    """(message, finish_reason) of a chat sample: its text, its thinking apart where the model
    thinks, its tool calls where the request offered tools (`seed` names the sample)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if params.get("reasoning"):
        reasoning, message["content"] = split_reasoning(text)
        if params.get("include_reasoning", True):
            message["reasoning_content"] = reasoning
    choice, form = params.get("tool_choice"), params.get("tool_parser")
    if choice in (None, "none"):
        return message, finish
    if choice == "auto":
        raw = _raw_text(token_ids, tokenizer)
        if params.get("reasoning"):
            raw = split_reasoning(raw)[1] or ""
        parsed = parse_calls(raw, str(form))
        if parsed is None:
            return message, finish
        message["content"], calls = parsed
    else:
        forced = forced_calls(message["content"] or "", choice)
        if forced is None:
            return message, finish
        message["content"], calls = None, forced
    message["tool_calls"] = [
        {"id": call_id(seed, k, form), "type": "function",
         "function": {"name": name, "arguments": arguments}}
        for k, (name, arguments) in enumerate(calls)
    ]  # fmt: skip
    return message, "tool_calls" if finish == "stop" and not isinstance(choice, dict) else finish


def _raw_text(token_ids: list[int], tokenizer: Any) -> str:
    """The reply with its special tokens (Llama's <|python_tag|>, Mistral's [TOOL_CALLS]) but
    not the ones that ended it."""
    specials = set(getattr(tokenizer, "all_special_ids", ()) or ())
    ids = list(token_ids)
    while ids and ids[-1] in specials:
        ids.pop()
    return str(tokenizer.decode(ids, skip_special_tokens=False))
