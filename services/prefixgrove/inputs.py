"""vLLM's `vllm.inputs` import path: the prompt shapes `LLM.generate` takes, besides a plain string.

Only text is served: a prompt holding `multi_modal_data` (or any key but these) is refused by name.
`cache_salt` is taken and changes nothing: one job's prefix cache serves one caller.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, tokenized with the model's tokenizer (its special tokens added)."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt as token ids, run as they are; `prompt` is only reported back."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
