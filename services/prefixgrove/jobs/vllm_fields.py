"""The request fields vLLM's OpenAI server takes beyond OpenAI's, as a batch body holds them.

Sampling fields become SamplingParams keyword arguments (checked here against the ranges the engine
takes); `echo` and what a chat's template is rendered with are kept apart:

- `echo` (completions: the prompt's text before the completion; chat: the last message's text
  before the reply when that message is the assistant's) travels in the params as `echo` /
  `echo_prefix`, which `sampling_kwargs` leaves out of SamplingParams;
- `chat_template_kwargs`, `add_generation_prompt` and `continue_final_message` are the chat
  template's options (`ChatOptions`), used where the messages are tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixgrove.jobs.request_body import INT32_MAX, Endpoint
from prefixgrove.jobs.request_errors import InvalidRequest, is_int, shown

# Params that shape the output line, not the sampling: never SamplingParams arguments.
OUTPUT_ONLY = (
    "echo", "echo_prefix", "prompt_parts", "tool_choice", "tool_parser", "reasoning",
    "include_reasoning", "encoding_format",
)  # fmt: skip
_MAX_PROMPT_LOGPROBS = 20
_MAX_BAD_WORDS = 256
# apply_chat_template's own arguments: chat_template_kwargs may not set them.
_TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


@dataclass(frozen=True)
class ChatOptions:
    """How a chat's messages are rendered: apply_chat_template's options."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            **self.template_kwargs,
        }


def add_vllm_sampling(params: dict[str, Any], body: dict[str, Any]) -> None:
    """Adds vLLM's sampling fields the body sets to `params` (SamplingParams keyword arguments)."""
    if body.get("min_tokens") is not None:
        params["min_tokens"] = _int(body["min_tokens"], "min_tokens", 0, params["max_tokens"])
    for name in ("include_stop_str_in_output", "skip_special_tokens"):
        if body.get(name) is not None:
            params[name] = _bool(body[name], name)
    if body.get("spaces_between_special_tokens") is not None:
        # vLLM reads it only where it detokenizes with a slow tokenizer; every model here
        # detokenizes with its fast one, where it changes nothing
        _bool(body["spaces_between_special_tokens"], "spaces_between_special_tokens")
    if body.get("prompt_logprobs") is not None:
        params["prompt_logprobs"] = _int(
            body["prompt_logprobs"], "prompt_logprobs", 0, _MAX_PROMPT_LOGPROBS
        )
    add_truncate_prompt_tokens(params, body)
    _add_token_controls(params, body)


def add_truncate_prompt_tokens(params: dict[str, Any], body: dict[str, Any]) -> None:
    """vLLM's truncate_prompt_tokens (a generation or an embedding line's): -1 or a count."""
    k = body.get("truncate_prompt_tokens")
    if k is not None:
        if not (is_int(k) and (k == -1 or 1 <= k <= INT32_MAX)):
            raise InvalidRequest(
                "invalid_value",
                "truncate_prompt_tokens must be -1 (the model's context length) or an integer "
                f"in [1, {INT32_MAX}], got {shown(k)}",
            )
        params["truncate_prompt_tokens"] = k


def _add_token_controls(params: dict[str, Any], body: dict[str, Any]) -> None:
    words = body.get("bad_words")
    if words is not None:
        if not (
            isinstance(words, list)
            and len(words) <= _MAX_BAD_WORDS
            and all(isinstance(w, str) and w.strip() for w in words)
        ):
            raise InvalidRequest(
                "invalid_value",
                f"bad_words must be a list of at most {_MAX_BAD_WORDS} non-blank strings, got "
                f"{shown(words)}",
            )
        params["bad_words"] = words
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not (
            isinstance(allowed, list)
            and allowed
            and all(is_int(t) and 0 <= t <= INT32_MAX for t in allowed)
        ):
            raise InvalidRequest(
                "invalid_value",
                "allowed_token_ids must be a non-empty list of token ids (integers in "
                f"[0, {INT32_MAX}]), got {shown(allowed)}",
            )
        params["allowed_token_ids"] = allowed


def add_echo(params: dict[str, Any], body: dict[str, Any], endpoint: Endpoint) -> None:
    """vLLM's `echo`: for completions the prompt's text comes first in each choice's text; for
    chat the last message's text comes first in the reply when that message is the assistant's
    (the reply continues it). Echoing prompt logprobs too is not served."""
    echo = body.get("echo")
    if echo is None or not _bool(echo, "echo"):
        return
    if endpoint == "completions":
        if body.get("logprobs") is not None:
            raise InvalidRequest(
                "unsupported_field",
                "echo with logprobs is not supported (the prompt's logprobs are not echoed): "
                "use prompt_logprobs for them, or leave out echo or logprobs",
            )
        params["echo"] = True
        return
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    if isinstance(last, dict) and last.get("role") == "assistant":
        content = last.get("content")
        if isinstance(content, str) and content:
            params["echo_prefix"] = content


def chat_options(body: dict[str, Any]) -> ChatOptions:
    """The chat template's options the body sets (each checked), else the defaults."""
    generation = body.get("add_generation_prompt")
    final = body.get("continue_final_message")
    options = ChatOptions(
        add_generation_prompt=True
        if generation is None
        else _bool(generation, "add_generation_prompt"),
        continue_final_message=False if final is None else _bool(final, "continue_final_message"),
        template_kwargs=_template_kwargs(body.get("chat_template_kwargs")),
    )
    if options.add_generation_prompt and options.continue_final_message:
        raise InvalidRequest(
            "invalid_value",
            "add_generation_prompt and continue_final_message cannot both be true: the reply "
            "either starts a new assistant message or continues the last one (set "
            "add_generation_prompt to false)",
        )
    return options


def _template_kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidRequest(
            "invalid_value", f"chat_template_kwargs must be an object, got {shown(kwargs)}"
        )
    reserved = sorted(set(kwargs) & _TEMPLATE_ARGUMENTS)
    if reserved:
        raise InvalidRequest(
            "invalid_value",
            f"chat_template_kwargs may not set {', '.join(reserved)}: give them as body fields "
            "where they are fields (add_generation_prompt, continue_final_message)",
        )
    return kwargs


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest("invalid_value", f"{name} must be a boolean, got {shown(value)}")
    return value


def _int(value: Any, name: str, low: int, high: int) -> int:
    if not is_int(value) or not low <= value <= high:
        raise InvalidRequest(
            "invalid_value", f"{name} must be an integer in [{low}, {high}], got {shown(value)}"
        )
    return int(value)
