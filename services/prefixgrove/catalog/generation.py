"""A checkpoint's own sampling defaults (its generation_config.json), read as vLLM reads them."""

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


def generation_defaults(model: str) -> dict[str, Any]:
    """SamplingParams keyword arguments from `model`'s generation_config.json; empty for presets,
    GGUF files and directories without one."""
    path = os.path.join(model, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    return {ours: raw[theirs] for theirs, ours in _FIELDS.items() if raw.get(theirs) is not None}
