"""Rotary position embeddings: one [cos | sin] row per position, with the checkpoint's rope scaling.

Frequencies and the attention scaling come from transformers' own rope initialisation
(`ROPE_INIT_FUNCTIONS`: yarn, dynamic, longrope and any type it adds); cos and sin are multiplied by
the attention scaling, as transformers' rotary modules do. `default`, `linear` and `llama3` keep the
engine's float64 formulas: the same math as transformers' (the tests compare them), but transformers
computes in float32, and the tables of the models served so far stay bit-identical.

transformers picks some frequencies by the current sequence length; a batch engine has one table row
per position, so the rule per position is:
- longrope: position p uses the long factors when p >= original_max_position_embeddings and the short
  ones below (vLLM's rule). transformers' cached generation computes exactly this for every token of
  a prompt within the original length and for every generated token; a longer prompt gets the long
  factors on all its tokens there, and the short ones on its first original_max_position_embeddings
  tokens here.
- dynamic: NTK rescales only past max_position_embeddings, which no request reaches (context_limit);
  every served position gets transformers' frequencies exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


def rope_parameters(theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """transformers 5's `rope_parameters` dict from a theta and an older-style `rope_scaling`."""
    params = {"rope_theta": theta, **(scaling or {})}
    params.setdefault("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    return params


def _default(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    return inv_freq


def _linear(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    return inv_freq / float(params["factor"])


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1's frequency-dependent scaling: long wavelengths are stretched by `factor`, short ones kept,
    # and the band between is interpolated smoothly.
    factor = float(params["factor"])
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    original = float(params["original_max_position_embeddings"])
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


_FLOAT64_SCALINGS: dict[str, Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
}


def supported_rope_types() -> tuple[str, ...]:
    return tuple(dict.fromkeys([*_FLOAT64_SCALINGS, *ROPE_INIT_FUNCTIONS]))


def float64_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """[head_dim // 2] float64 frequencies of a `default`, `linear` or `llama3` rope."""
    theta = float(params["rope_theta"])
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    return _FLOAT64_SCALINGS[params["rope_type"]](inv_freq, params)


def transformers_frequencies(
    head_dim: int, max_position_embeddings: int, params: dict[str, Any], seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention scaling) from transformers' rope initialisation,
    for a sequence of `seq_len` tokens (None: what transformers computes when the model is built)."""
    config = LlamaConfig(
        head_dim=head_dim,
        hidden_size=head_dim,
        num_attention_heads=1,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=dict(params),
    )
    # transformers 5 keeps `default` on the rotary modules, not in ROPE_INIT_FUNCTIONS.
    rope_type = params["rope_type"]
    init = (
        LlamaRotaryEmbedding.compute_default_rope_parameters
        if rope_type == "default"
        else ROPE_INIT_FUNCTIONS[rope_type]
    )
    inv_freq, attention_scaling = init(config, seq_len=seq_len)
    if inv_freq.shape != (head_dim // 2,):
        raise ValueError(
            f"rope parameters {params} rotate {2 * inv_freq.numel()} of {head_dim} head dims; "
            "only full-head rotary (partial_rotary_factor 1.0) is supported"
        )
    return inv_freq, float(attention_scaling)


def _cos_sin(
    inv_freq: torch.Tensor, start: int, stop: int, attention_scaling: float
) -> torch.Tensor:
    # float64 angles: a float32 frequency times any position is exact, and the float64 formulas keep
    # their precision far out (transformers multiplies in float32).
    angles = torch.outer(torch.arange(start, stop, dtype=torch.float64), inv_freq.double())
    return (torch.cat([angles.cos(), angles.sin()], dim=-1) * attention_scaling).float()


def rotary_table(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict[str, Any] | None,
    *,
    max_position_embeddings: int | None = None,
) -> torch.Tensor:
    """[max_positions, head_dim] fp32 = [cos | sin] of each position's rotation angles (GPT-NeoX
    "rotate half" layout, as Hugging Face's Llama), times the rope's attention scaling, kept in fp32
    whatever the model dtype. `max_position_embeddings` is the config's (default: max_positions)."""
    params = rope_parameters(theta, scaling)
    rope_type = params["rope_type"]
    if rope_type in _FLOAT64_SCALINGS:
        return _cos_sin(float64_frequencies(head_dim, params), 0, max_positions, 1.0)
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(supported_rope_types())}"
        )
    limit = max_position_embeddings or max_positions
    inv_freq, attention_scaling = transformers_frequencies(head_dim, limit, params)
    if rope_type != "longrope":
        return _cos_sin(inv_freq, 0, max_positions, attention_scaling)
    original = int(params["original_max_position_embeddings"])
    long_freq, _ = transformers_frequencies(head_dim, limit, params, seq_len=original + 1)
    short_rows = min(original, max_positions)
    return torch.cat(
        [
            _cos_sin(inv_freq, 0, short_rows, attention_scaling),
            _cos_sin(long_freq, short_rows, max_positions, attention_scaling),
        ]
    )
