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
    rotary: Any  # (q, k, positions, cos_sin) -> (q, k) rotated
    silu_and_mul: Any  # [n, 2d] (gate | up) -> [n, d]


def create_ops(name: str) -> ModelOps:
    from prefixgrove.kernels import activation, rmsnorm, rotary

    if name == "triton":
        return ModelOps("triton", rmsnorm.rms_norm, _rotary_in_place, activation.silu_and_mul)
    if name == "torch":
        return ModelOps(
            "torch", rmsnorm.rms_norm_ref, rotary.apply_rotary_ref, activation.silu_and_mul_ref
        )
    raise ValueError(f"model ops {name!r} are unknown; expected 'triton' or 'torch'")


def _rotary_in_place(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from prefixgrove.kernels.rotary import apply_rotary

    # q and k are views of the fused qkv output: rotating them where they are saves two copies.
    return apply_rotary(q, k, positions, cos_sin, q_out=q, k_out=k)
