"""The elementwise operations around the model's matmuls, in two implementations of the same math: fused
Triton kernels ("triton", with the Triton attention backend) and their plain torch references ("torch")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ModelOps:
    name: str
    rms_norm: Any  # (x, weight, eps[, residual]) -> out | (out, x + residual)
    # (q, k, v, positions, cos_sin, k_cache, v_cache, slots) -> q rotated; the rotated keys and the
    # values are written to their slots of the paged cache
    rotary_to_cache: Any
    silu_and_mul: Any  # [n, 2d] (gate | up) -> [n, d]


def create_ops(name: str) -> ModelOps:
    from prefixgrove_kernels import activation, rmsnorm, rotary

    if name == "triton":
        return ModelOps("triton", rmsnorm.rms_norm, _rotary_to_cache, activation.silu_and_mul)
    if name == "torch":
        return ModelOps(
            "torch",
            rmsnorm.rms_norm_ref,
            rotary.apply_rotary_to_cache_ref,
            activation.silu_and_mul_ref,
        )
    raise ValueError(f"model ops {name!r} are unknown; expected 'triton' or 'torch'")


def _rotary_to_cache(q: torch.Tensor, *k_v_and_cache: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_to_cache` (arguments as in ModelOps.rotary_to_cache) rotating q where it is."""
    from prefixgrove_kernels.rotary import apply_rotary_to_cache

    # q is a view of the fused qkv output: rotating it where it is saves a copy; the keys go to the
    # cache rotated in the same launch (no rotated k tensor, no index_copy_ of k and v).
    return apply_rotary_to_cache(q, *k_v_and_cache, q_out=q)
