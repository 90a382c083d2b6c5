"""Rotary position embeddings with the rope scalings Llama-family checkpoints use."""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2], with the checkpoint's rope scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported; supported: default, linear, llama3"
    )


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1's frequency-dependent scaling: long wavelengths are stretched by `factor`, short ones kept,
    # and the band between is interpolated smoothly.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_table(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """[max_positions, head_dim] fp32 = [cos | sin] of each position's rotation angles (GPT-NeoX
    "rotate half" layout, as Hugging Face's Llama), kept in fp32 whatever the model dtype."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()
