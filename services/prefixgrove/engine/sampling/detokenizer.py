"""Incremental detokenization: each new token costs a decode of a few tokens, not of the whole output.

Text is only produced where it is needed while a request runs (stop strings); everything else is decoded
once, when the request finishes, so the GPU loop never waits on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Tokens decoded again before the new ones, so that merges across token boundaries (and multi-byte
# characters split over several tokens) come out right.
_CONTEXT = 6


@dataclass
class DetokState:
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""


class Detokenizer:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        # Ids the model can emit but the tokenizer does not know (random-weight presets) decode to nothing;
        # without a tokenizer (skip_tokenizer_init) no id has text.
        self.known = 0 if tokenizer is None else min(vocab_size, len(tokenizer))
        # token id -> its text alone: a logprobs job names the same tokens again and again
        self._token_texts: dict[int, str] = {}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        ids = [t for t in token_ids if t < self.known]
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (a logprob's decoded_token)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def step(
        self, state: DetokState, token_ids: list[int], skip_special_tokens: bool = True
    ) -> str:
        """Appends the text of token_ids[state.read_offset:] to state.text; returns the new part."""
        prefix = self.decode(
            token_ids[state.prefix_offset : state.read_offset], skip_special_tokens
        )
        full = self.decode(token_ids[state.prefix_offset :], skip_special_tokens)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        new = full[len(prefix) :]
        state.text += new
        state.read_offset = len(token_ids)
        state.prefix_offset = max(0, state.read_offset - _CONTEXT)
        return new
