"""A checkpoint's generation_config.json, read as vLLM reads it: its sampling defaults and the EOS
ids that end generation besides the tokenizer's."""

from __future__ import annotations

import json
import os
from typing import Any

# generation_config.json key -> SamplingParams field (the ones vLLM takes over).
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# transformers' GenerationConfig defaults: vLLM takes over only the values that differ from them
# (GenerationConfig.to_diff_dict), so a file that spells out top_k=50 leaves top_k alone.
_TRANSFORMERS_DEFAULTS = {"top_k": 50}


def generation_defaults(
    model: str, source: str = "auto", overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """SamplingParams keyword arguments from `model`'s generation_config.json (source "auto"; none
    for presets, GGUF files and directories without one) or from none of it (source "vllm"), then
    `overrides` (generation_config names, e.g. max_new_tokens), as vLLM's `generation_config` and
    `override_generation_config` arguments give them."""
    if source not in ("auto", "vllm"):
        raise ValueError(
            f"generation_config={source!r} is not supported: 'auto' reads the model's "
            "generation_config.json, 'vllm' keeps SamplingParams' own defaults"
        )
    raw = _read(model) if source == "auto" else {}
    raw = {k: v for k, v in raw.items() if v != _TRANSFORMERS_DEFAULTS.get(k)}
    raw.update(overrides or {})
    return {ours: raw[theirs] for theirs, ours in _FIELDS.items() if raw.get(theirs) is not None}


def generation_eos_token_ids(model: str) -> tuple[int, ...]:
    """The file's eos_token_id (an int or a list of them); every one ends generation."""
    raw = _read(model)
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(_is_id(t) for t in ids):
        raise ValueError(
            f"{_path(model)}: eos_token_id={eos!r} is invalid: expected a token id or a list of them"
        )
    return tuple(ids)


def _read(model: str) -> dict[str, Any]:
    path = _path(model)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    return raw


def _path(model: str) -> str:
    return os.path.join(model, "generation_config.json")


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
