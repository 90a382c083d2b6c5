"""Rotary position embeddings (GPT-NeoX "rotate half" layout) on q and k in one launch.

One program per token reads its position's [cos | sin] row once and rotates every query and key
head of that token, in fp32, rounding once to the input dtype. Writes new tensors, or updates q
and k in place when they are passed as the outputs.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from prefixgrove.kernels import checks
from prefixgrove.kernels.launch import KernelLaunch

ROTARY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
POSITION_DTYPES = (torch.int32, torch.int64)
MIN_HEAD_DIM = 8
# Elements (heads x half head_dim) one tile holds.
TILE_ELEMENTS = 2048


@triton.jit
def _rotate_heads(
    src_ptr,  # [tokens, heads, HEAD_DIM] of one token's row, already offset
    dst_ptr,
    num_heads,
    src_stride_h,
    dst_stride_h,
    cos,  # [HALF] fp32
    sin,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
):
    dims = tl.arange(0, HALF)
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None]
        src = src_ptr + heads[:, None] * src_stride_h + dims[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        dst = dst_ptr + heads[:, None] * dst_stride_h + dims[None, :]
        tl.store(dst, o1.to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, o2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # q: [tokens, num_heads, HEAD_DIM]
    k_ptr,  # k: [tokens, num_kv_heads, HEAD_DIM]
    q_out_ptr,  # like q
    k_out_ptr,  # like k
    pos_ptr,  # positions: [tokens] int32/int64
    cos_sin_ptr,  # cos_sin: [max_positions, HEAD_DIM] fp32 = [cos | sin]
    num_heads,
    num_kv_heads,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    q_out_stride_t,
    q_out_stride_h,
    k_out_stride_t,
    k_out_stride_h,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + dims)
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + HALF + dims)
    _rotate_heads(
        q_ptr + token * q_stride_t,
        q_out_ptr + token * q_out_stride_t,
        num_heads,
        q_stride_h,
        q_out_stride_h,
        cos,
        sin,
        BLOCK_HQ,
        HALF,
    )
    _rotate_heads(
        k_ptr + token * k_stride_t,
        k_out_ptr + token * k_out_stride_t,
        num_kv_heads,
        k_stride_h,
        k_out_stride_h,
        cos,
        sin,
        BLOCK_HK,
        HALF,
    )


def _check_heads(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    checks.check_tensor(name, t, ndim=3, dtypes=dtypes, device=t.device, contiguous=False)
    checks.check_unit_last_stride(name, t)


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> None:
    _check_heads("q", q, ROTARY_DTYPES)
    head_dim = q.shape[2]
    if not checks.is_power_of_two(head_dim) or head_dim < MIN_HEAD_DIM:
        raise ValueError(
            f"head_dim {head_dim} is not supported; use a power of two >= {MIN_HEAD_DIM}"
        )
    checks.check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device, contiguous=False)
    checks.check_unit_last_stride("k", k)
    if k.shape[0] != q.shape[0] or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} in tokens and head_dim")
    checks.check_tensor("positions", positions, ndim=1, dtypes=POSITION_DTYPES, device=q.device)
    checks.check_shape("positions", positions, (q.shape[0],))
    checks.check_tensor("cos_sin", cos_sin, ndim=2, dtypes=(torch.float32,), device=q.device)
    if cos_sin.shape[1] != head_dim:
        raise ValueError(
            f"cos_sin must be [max_positions, {head_dim}] = [cos | sin], got {tuple(cos_sin.shape)}"
        )


def _check_output(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    _check_heads(name, t, (like.dtype,))
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but the queries are on {like.device}")
    checks.check_shape(name, t, tuple(like.shape))


def _block_heads(num_heads: int, head_dim: int) -> int:
    cap = max(1, TILE_ELEMENTS // (head_dim // 2))
    return min(triton.next_power_of_2(max(num_heads, 1)), cap)


def apply_rotary_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[KernelLaunch | None, torch.Tensor, torch.Tensor]:
    """Checks the arguments and plans the launch `apply_rotary` makes."""
    _check_inputs(q, k, positions, cos_sin)
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format) if q_out is None else q_out
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format) if k_out is None else k_out
    _check_output("q_out", q_out, q)
    _check_output("k_out", k_out, k)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return None, q_out, k_out
    args: tuple[Any, ...] = (q, k, q_out, k_out, positions, cos_sin, num_heads, k.shape[1])
    args += (q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    args += (q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1))
    options = {
        "BLOCK_HQ": _block_heads(num_heads, head_dim),
        "BLOCK_HK": _block_heads(k.shape[1], head_dim),
        "HEAD_DIM": head_dim,
        "num_warps": 4,
        # NOTE: no fused multiply-adds, so x1*cos - x2*sin rounds like the torch reference.
        "enable_fp_fusion": False,
    }
    return KernelLaunch(_rotary_kernel, (num_tokens,), args, options), q_out, k_out


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k by their tokens' positions; returns (q_out, k_out).

    q: [tokens, num_heads, head_dim], k: [tokens, num_kv_heads, head_dim] (unit last stride,
    other strides free: views of a fused qkv output), positions: [tokens] int32/int64, each in
    [0, max_positions) (not checked: that would sync with the device), cos_sin: [max_positions,
    head_dim] fp32. Pass q_out=q, k_out=k to rotate in place.
    """
    launch, q_out, k_out = apply_rotary_launch(q, k, positions, cos_sin, q_out=q_out, k_out=k_out)
    if launch is not None:
        launch.run()
    return q_out, k_out


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().split(x.shape[-1] // 2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `apply_rotary` (the engine's unfused RotaryEmbedding)."""
    _check_inputs(q, k, positions, cos_sin)
    cos, sin = cos_sin[positions].unsqueeze(1).split(q.shape[2] // 2, dim=-1)
    return _rotate_ref(q, cos, sin), _rotate_ref(k, cos, sin)
