"""The paged KV cache of each layer: K and V in the model's dtype, or in FP8 with a scale each.

kv_cache_dtype "auto" keeps keys and values in the model's dtype. "fp8" (alias "fp8_e4m3") stores them
as float8_e4m3fn, half the bytes of bf16/fp16, so the same memory holds twice the blocks: the cache
holds k / k_scale and v / v_scale, saturated to +-448 and rounded to nearest by the rotary kernel that
writes them, and the attention kernels multiply them back by the scale as they load them. A layer's
scales are float32 tensors of one value, 1.0 (what vLLM uses without calibrated scales), allocated once
beside its cache, so a captured CUDA graph reads them where they are.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from prefixgrove_kernels.checks import FP8_KV_DTYPE

__all__ = ["FP8_KV_DTYPE", "KV_CACHE_DTYPES", "Fp8Cache", "LayerCache", "allocate", "unpack"]

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={name!r} is not supported; expected one of "
            f"{', '.join(repr(n) for n in KV_CACHE_DTYPES)}"
        )


def cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the cache tensors: the model's for "auto", float8_e4m3fn for FP8."""
    check_kv_cache_dtype(kv_cache_dtype)
    return model_dtype if kv_cache_dtype == "auto" else FP8_KV_DTYPE


class Fp8Cache(NamedTuple):
    """One layer's keys (or values) in FP8: `codes` * `scale` is what they stand for."""

    codes: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim] float8_e4m3fn
    scale: torch.Tensor  # [1] float32


# What a layer's k (or v) cache is: a tensor in the model's dtype, or an FP8 one with its scale
LayerCache = torch.Tensor | Fp8Cache


def unpack(cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the cache tensor, its scale or None) as the kernels take them."""
    if isinstance(cache, Fp8Cache):
        return cache.codes, cache.scale
    return cache, None


def allocate(
    num_layers: int,
    shape: tuple[int, int, int, int],
    model_dtype: torch.dtype,
    kv_cache_dtype: str,
    device: torch.device,
) -> list[tuple[LayerCache, LayerCache]]:
    """Every layer's (k, v) caches of `shape`, zeroed; FP8 ones with scales of 1.0."""
    dtype = cache_torch_dtype(kv_cache_dtype, model_dtype)

    def one() -> LayerCache:
        cache = torch.zeros(shape, dtype=dtype, device=device)
        if dtype != FP8_KV_DTYPE:
            return cache
        return Fp8Cache(cache, torch.ones(1, dtype=torch.float32, device=device))

    return [(one(), one()) for _ in range(num_layers)]
