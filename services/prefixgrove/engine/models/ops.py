"""The elementwise operations around the model's matmuls, in two implementations of the same math: fused
Triton kernels ("triton", with the Triton attention backend) and their plain torch references ("torch")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..attention.kv_cache import LayerCache, unpack


@dataclass(frozen=True)
class ModelOps:
    name: str
    rms_norm: Any  # (x, weight, eps[, residual]) -> out | (out, x + residual)
    # (q, k, v, positions, cos_sin, k_cache, v_cache, slots) -> q rotated; the rotated keys and the
    # values are written to their slots of the paged cache (a layer's caches as the model runner
    # allocates them: tensors, or FP8 caches with their scales, see attention/kv_cache.py)
    rotary_to_cache: Any
    silu_and_mul: Any  # [n, 2d] (gate | up) -> [n, d]
    gelu_tanh_and_mul: Any  # the same with gelu (tanh approximation): Gemma's GeGLU
    # rms_norm and silu_and_mul with their outputs as an FP8 linear layer takes them (e4m3 values,
    # float32 scales [rows, 1]: the bytes the layer's own per-token quantization would write)
    rms_norm_fp8: Any  # (x [rows, hidden], weight, eps, residual | None) -> (q, scales, sum | None)
    silu_and_mul_fp8: Any  # [n, 2d] (gate | up) -> (q [n, d], scales [n, 1])
    gelu_tanh_and_mul_fp8: Any


def create_ops(name: str) -> ModelOps:
    from prefixgrove_kernels import activation, rmsnorm, rotary

    if name not in ("triton", "torch"):
        raise ValueError(f"model ops {name!r} are unknown; expected 'triton' or 'torch'")
    fused = name == "triton"

    def pick(kernel: Any, reference: Any) -> Any:
        return kernel if fused else reference

    # q is a view of the fused qkv output: rotating it where it is saves a copy; the keys go to
    # the cache rotated in the same launch (no rotated k tensor, no index_copy_ of k and v).
    rotary_to_cache = _on_layer_caches(
        pick(rotary.apply_rotary_to_cache, rotary.apply_rotary_to_cache_ref),
        rotate_q_in_place=fused,
    )
    return ModelOps(
        name=name,
        rms_norm=pick(rmsnorm.rms_norm, rmsnorm.rms_norm_ref),
        rotary_to_cache=rotary_to_cache,
        silu_and_mul=pick(activation.silu_and_mul, activation.silu_and_mul_ref),
        gelu_tanh_and_mul=pick(activation.gelu_tanh_and_mul, activation.gelu_tanh_and_mul_ref),
        rms_norm_fp8=pick(rmsnorm.rms_norm_fp8, rmsnorm.rms_norm_fp8_ref),
        silu_and_mul_fp8=pick(activation.silu_and_mul_fp8, activation.silu_and_mul_fp8_ref),
        gelu_tanh_and_mul_fp8=pick(
            activation.gelu_tanh_and_mul_fp8, activation.gelu_tanh_and_mul_fp8_ref
        ),
    )


def _on_layer_caches(apply: Any, rotate_q_in_place: bool = False) -> Any:
    """`apply` (`apply_rotary_to_cache` or its reference) taking a layer's caches as the model runner
    allocates them (arguments as in ModelOps.rotary_to_cache): an FP8 cache's scales go beside it."""

    def rotary_to_cache(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        k_cache: LayerCache,
        v_cache: LayerCache,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        (k_codes, k_scale), (v_codes, v_scale) = unpack(k_cache), unpack(v_cache)
        q_out = {"q_out": q} if rotate_q_in_place else {}
        return apply(
            q, k, v, positions, cos_sin, k_codes, v_codes, slots, k_scale=k_scale,
            v_scale=v_scale, **q_out,
        )  # fmt: skip

    return rotary_to_cache
