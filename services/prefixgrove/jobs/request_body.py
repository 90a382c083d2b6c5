"""A request's body, chat or completions: the fields each endpoint accepts, those it refuses by
name, and its prompt (text or token ids); its messages are chat_messages.py's. The sampling fields are
sampling_fields.py's (vLLM's own fields vllm_fields.py's), the output constraint
structured_fields.py's."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from prefixgrove.jobs.request_errors import InvalidRequest, shown
from prefixgrove.jobs.structured_fields import STRUCTURED_FIELDS

Endpoint = Literal["completions", "chat", "embeddings"]

URLS: dict[str, Endpoint] = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/embeddings": "embeddings",
}
INT32_MAX = 2**31 - 1  # token ids, max_tokens, top_k and stop_token_ids live in int32 tensors
# vLLM's own fields beyond OpenAI's (vllm_fields.py reads them)
VLLM_FIELDS = {
    "min_tokens", "bad_words", "allowed_token_ids", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "prompt_logprobs",
    "truncate_prompt_tokens", "echo",
}  # fmt: skip
VLLM_CHAT_FIELDS = {
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "include_reasoning",
}  # fmt: skip
_COMMON_BODY_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "logprobs", "ignore_eos", "n", "stream", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop_token_ids", "logit_bias", "user", "stream_options",
    *STRUCTURED_FIELDS, *VLLM_FIELDS,
}  # fmt: skip
# Documented OpenAI fields that change nothing in an offline batch: accepted and ignored.
_IGNORED_CHAT_FIELDS = {
    "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
    "safety_identifier",
}  # fmt: skip
# Documented OpenAI fields whose feature is not served: a request setting one fails, naming it.
_UNSERVED_FIELDS: dict[Endpoint, dict[str, str]] = {
    "embeddings": {},
    "completions": {"suffix": "insertion (suffix)"},
    "chat": {
        "functions": "function calling (deprecated by OpenAI: use tools)",
        "function_call": "function calling (deprecated by OpenAI: use tool_choice)",
        "audio": "audio output",
        "prediction": "predicted outputs", "web_search_options": "web search",
        "reasoning_effort": "reasoning models", "verbosity": "reasoning models",
    },
}  # fmt: skip
_BODY_FIELDS: dict[Endpoint, set[str]] = {
    # OpenAI's, then vLLM's (embedding_fields.py)
    "embeddings": {"model", "input", "encoding_format", "dimensions", "user", "normalize",
                   "truncate_prompt_tokens"},
    "completions": _COMMON_BODY_FIELDS | set(_UNSERVED_FIELDS["completions"])
    | {"prompt", "best_of"},
    "chat": _COMMON_BODY_FIELDS | _IGNORED_CHAT_FIELDS | set(_UNSERVED_FIELDS["chat"])
    | VLLM_CHAT_FIELDS
    | {"messages", "top_logprobs", "max_completion_tokens", "modalities", "tools", "tool_choice"},
}  # fmt: skip


def check_body_fields(body: dict[str, Any], endpoint: Endpoint, url: str) -> None:
    """Fails a body holding a field its endpoint does not know, or asking for a documented
    feature this server does not provide."""
    unknown = sorted(set(body) - _BODY_FIELDS[endpoint])
    if unknown:
        raise InvalidRequest(
            "unknown_field",
            f"unknown body field(s) {unknown} for {url}; accepted: {sorted(_BODY_FIELDS[endpoint])}",
        )
    for name, feature in _UNSERVED_FIELDS[endpoint].items():
        if body.get(name) is not None:
            raise InvalidRequest(
                "unsupported_field",
                f"{name} is not supported: {feature} is not served; remove {name} from the body",
            )
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise InvalidRequest(
            "unsupported_field",
            f"modalities {shown(modalities)} is not supported: only ['text'] is served",
        )


def body_model(model: Any) -> str | None:
    if model is None or (isinstance(model, str) and model):
        return model
    raise InvalidRequest("invalid_value", f"model must be a non-empty string, got {shown(model)}")


MAX_PROMPTS = 128  # prompts in one completions line (OpenAI's list of prompts)


def body_prompt(
    prompt: Any, most: int = MAX_PROMPTS, name: str = "prompt"
) -> str | np.ndarray | list[str] | list[np.ndarray]:
    """A completions prompt (an embeddings input): its text, or its token ids (int64); several
    (a list of strings, or of token-id lists: prompt_parts.py) as a list of either."""
    # A one-element list is how the OpenAI API spells a single prompt too.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and _all_ints(prompt):
        return _token_ids(prompt)
    if isinstance(prompt, list) and 1 < len(prompt) <= most:
        if all(isinstance(p, str) and p for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and _all_ints(p) for p in prompt):
            return [_token_ids(p) for p in prompt]
    raise InvalidRequest(
        "invalid_prompt",
        f"{name} must be a non-empty string, a non-empty list of token ids, or a list of up to "
        f"{most} of either (each non-empty, all of one kind), got {shown(prompt)}",
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
    raise InvalidRequest(
        "invalid_token_id",
        f"prompt token {shown(token)} at position {i} is not a token id: ids are "
        f"integers in [0, {INT32_MAX}] (and below the model's vocabulary size)",
    )
