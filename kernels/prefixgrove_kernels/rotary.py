"""Rotary position embeddings (GPT-NeoX "rotate half" layout) on q and k in one launch.

One program per token reads its position's [cos | sin] row once and rotates every query and key
head of that token, in fp32, rounding once to the input dtype. Writes new tensors, or updates q
and k in place when they are passed as the outputs.

`apply_rotary_to_cache` is the attention layer's form: the rotated keys go straight to their slots of
the paged KV cache and the values are copied next to them in the same launch, instead of a rotated
k tensor that two more kernels (index_copy_ of k, then of v) would write into the cache. An FP8 cache
(float8_e4m3fn) gets k / k_scale and v / v_scale, saturated to +-448 and rounded to nearest (ties to
even), after the rotated key is rounded to k's dtype as the unfused path rounds it.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from prefixgrove_kernels import checks
from prefixgrove_kernels.calls import takes_arguments_of
from prefixgrove_kernels.launch import KernelLaunch
from prefixgrove_kernels.reference_math import quantize_kv

ROTARY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = (*ROTARY_DTYPES, checks.FP8_KV_DTYPE)
POSITION_DTYPES = (torch.int32, torch.int64)
MIN_HEAD_DIM = 8
# Elements (heads x half head_dim) one tile holds.
TILE_ELEMENTS = 2048


@dataclass(frozen=True, eq=False, slots=True)
class RotaryToCacheCall:
    """`apply_rotary_to_cache`'s arguments (see there), which its launch planner and its torch
    reference take too."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    _: KW_ONLY
    q_out: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@triton.jit
def to_e4m3(x, scale):
    """x / scale (fp32) as e4m3: saturated to +-448 and rounded to nearest, ties to even, in fp32
    arithmetic (as torch's cast rounds), so that the cast at the end is exact on every target."""
    y = tl.div_rn(x, scale)
    a = tl.minimum(tl.abs(y), 448.0)
    # a's e4m3 binade (the subnormals share the lowest, -6), whose values are multiples of
    # 2^(binade - 3): adding 2^(binade + 20), whose fp32 ulp is that step, rounds a to one (a is below
    # 2^(binade + 1), so the sum stays in that power's binade); subtracting it back is exact.
    binade = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)
    magic = ((binade + 20 + 127) << 23).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    # y's sign bit onto r (-0.0 included, which a negation, 0 - r on the GPU, would lose).
    sign = (y.to(tl.uint32, bitcast=True) >> 31) << 31
    r = (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return r.to(tl.float8e4nv)


@triton.jit
def _to_dst(x, like, scale, dst_ptr):
    """x (fp32) as dst_ptr stores it: rounded to `like`'s dtype, then, for an FP8 cache, divided by
    scale and quantized (the unfused path's index_copy_ of the rounded tensor, then the cast)."""
    x = x.to(like.dtype)
    if dst_ptr.dtype.element_ty == tl.float8e4nv:
        return to_e4m3(x.to(tl.float32), scale)
    return x.to(dst_ptr.dtype.element_ty)


@triton.jit
def _write_heads(
    src_ptr,  # [tokens, heads, HEAD_DIM] of one token's row, already offset
    dst_ptr,
    num_heads,
    src_stride_h,
    dst_stride_h,
    cos,  # [WIDTH] fp32 (ROTATE only)
    sin,
    scale,  # with an FP8 dst: what it stores is x / scale
    BLOCK_H: tl.constexpr,
    WIDTH: tl.constexpr,  # ROTATE: half the head (one half at a time); else the whole head
    ROTATE: tl.constexpr,  # rotate the two halves by cos and sin; else copy as it is
):
    dims = tl.arange(0, WIDTH)
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None]
        src = src_ptr + heads[:, None] * src_stride_h + dims[None, :]
        if ROTATE:
            x1_in = tl.load(src, mask=mask, other=0.0)
            x1 = x1_in.to(tl.float32)
            x2 = tl.load(src + WIDTH, mask=mask, other=0.0).to(tl.float32)
            o1 = x1 * cos[None, :] - x2 * sin[None, :]
            o2 = x2 * cos[None, :] + x1 * sin[None, :]
            dst = dst_ptr + heads[:, None] * dst_stride_h + dims[None, :]
            tl.store(dst, _to_dst(o1, x1_in, scale, dst_ptr), mask=mask)
            tl.store(dst + WIDTH, _to_dst(o2, x1_in, scale, dst_ptr), mask=mask)
        else:
            x = tl.load(src, mask=mask)
            dst = dst_ptr + heads[:, None] * dst_stride_h + dims[None, :]
            tl.store(dst, _to_dst(x, x, scale, dst_ptr), mask=mask)  # x in its own dtype


@triton.jit
def _rotary_kernel(
    q_ptr,  # q: [tokens, num_heads, HEAD_DIM]
    k_ptr,  # k: [tokens, num_kv_heads, HEAD_DIM]
    v_ptr,  # v: like k (read only with TO_CACHE)
    q_out_ptr,  # like q
    k_out_ptr,  # like k, or with TO_CACHE the key cache viewed as [slots, num_kv_heads, HEAD_DIM]
    v_out_ptr,  # with TO_CACHE the value cache, like the key cache
    pos_ptr,  # positions: [tokens] int32/int64
    slots_ptr,  # with TO_CACHE: [tokens] int32/int64, the cache slot of each token's key and value
    cos_sin_ptr,  # cos_sin: [max_positions, HEAD_DIM] fp32 = [cos | sin]
    k_scale_ptr,  # with TO_CACHE into an FP8 cache: [1] fp32 each, the cache stores k / k_scale
    v_scale_ptr,
    num_heads,
    num_kv_heads,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    q_out_stride_t,
    q_out_stride_h,
    k_out_stride_t,
    k_out_stride_h,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TO_CACHE: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + dims)
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + HALF + dims)
    # The key (and value) row this token writes: its own, or its cache slot.
    k_row = token
    k_scale = 1.0
    v_scale = 1.0
    if TO_CACHE:
        k_row = tl.load(slots_ptr + token).to(tl.int64)
        if k_out_ptr.dtype.element_ty == tl.float8e4nv:
            k_scale = tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)
    _write_heads(
        q_ptr + token * q_stride_t, q_out_ptr + token * q_out_stride_t, num_heads, q_stride_h,
        q_out_stride_h, cos, sin, 1.0, BLOCK_HQ, HALF, True,
    )  # fmt: skip
    _write_heads(
        k_ptr + token * k_stride_t, k_out_ptr + k_row * k_out_stride_t, num_kv_heads, k_stride_h,
        k_out_stride_h, cos, sin, k_scale, BLOCK_HK, HALF, True,
    )  # fmt: skip
    if TO_CACHE:
        _write_heads(
            v_ptr + token * v_stride_t, v_out_ptr + k_row * k_out_stride_t, num_kv_heads,
            v_stride_h, k_out_stride_h, cos, sin, v_scale, BLOCK_HK, HEAD_DIM, False,
        )  # fmt: skip


def _check_heads(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    checks.check_tensor(name, t, ndim=3, dtypes=dtypes, device=t.device, contiguous=False)
    checks.check_unit_last_stride(name, t)


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kernel: bool = True,
) -> None:
    """kernel: the Triton launch's own limits too (the references take any even head size)."""
    _check_heads("q", q, ROTARY_DTYPES)
    head_dim = q.shape[2]
    if kernel and (not checks.is_power_of_two(head_dim) or head_dim < MIN_HEAD_DIM):
        raise ValueError(
            f"head_dim {head_dim} is not supported; use a power of two >= {MIN_HEAD_DIM}"
        )
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} is odd: rotary pairs its two halves")
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


def _check_like(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    """t (an output, or v beside k) has like's dtype, device and shape, and a unit last stride."""
    _check_heads(name, t, (like.dtype,))
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but the queries are on {like.device}")
    checks.check_shape(name, t, tuple(like.shape))


def _new_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, memory_format=torch.contiguous_format)


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
    q_out = _new_like(q) if q_out is None else q_out
    k_out = _new_like(k) if k_out is None else k_out
    _check_like("q_out", q_out, q)
    _check_like("k_out", k_out, k)
    if q.shape[0] == 0:
        return None, q_out, k_out
    # Without a cache the value, slot and scale arguments are never read (TO_CACHE is off): k and
    # positions stand in.
    args = _launch_args(q, k, k, q_out, k_out, k_out, positions, positions, cos_sin, (k, k))
    return _launch(args, q, k, to_cache=False), q_out, k_out


def _launch_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cos_sin: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor],
) -> tuple[Any, ...]:
    args: tuple[Any, ...] = (q, k, v, q_out, k_out, v_out, positions, slots, cos_sin, *scales)
    args += (q.shape[1], k.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    args += (v.stride(0), v.stride(1), q_out.stride(0), q_out.stride(1))
    return (*args, k_out.stride(0), k_out.stride(1))


def _launch(
    args: tuple[Any, ...], q: torch.Tensor, k: torch.Tensor, to_cache: bool
) -> KernelLaunch:
    head_dim = q.shape[2]
    options = {
        "BLOCK_HQ": _block_heads(q.shape[1], head_dim),
        "BLOCK_HK": _block_heads(k.shape[1], head_dim),
        "HEAD_DIM": head_dim,
        "TO_CACHE": to_cache,
        "num_warps": 4,
        # NOTE: no fused multiply-adds, so x1*cos - x2*sin rounds like the torch reference.
        "enable_fp_fusion": False,
    }
    return KernelLaunch(_rotary_kernel, (q.shape[0],), args, options)


@takes_arguments_of(apply_rotary_launch)
def apply_rotary(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k by their tokens' positions; returns (q_out, k_out).

    q: [tokens, num_heads, head_dim], k: [tokens, num_kv_heads, head_dim] (unit last stride,
    other strides free: views of a fused qkv output), positions: [tokens] int32/int64, each in
    [0, max_positions) (not checked: that would sync with the device), cos_sin: [max_positions,
    head_dim] fp32. Pass q_out=q, k_out=k to rotate in place.
    """
    launch, q_out, k_out = apply_rotary_launch(*args, **kwargs)
    if launch is not None:
        launch.run()
    return q_out, k_out


def _check_cache_args(call: RotaryToCacheCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks what `_check_inputs` does not; returns the scale arguments of the launch (see
    `checks.kv_scale_args`)."""
    k, k_cache, v_cache = call.k, call.k_cache, call.v_cache
    _check_like("v", call.v, k)
    if call.q_out is not None:
        _check_like("q_out", call.q_out, call.q)
    cache_shape = (k_cache.shape[0], k_cache.shape[1], *k.shape[1:]) if k_cache.ndim == 4 else None
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        checks.check_tensor(name, cache, ndim=4, dtypes=CACHE_DTYPES, device=k.device)
        if cache_shape is None or tuple(cache.shape) != cache_shape:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, {k.shape[1]}, {k.shape[2]}] like "
                f"k_cache, got {tuple(cache.shape)}"
            )
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache is {v_cache.dtype} but k_cache is {k_cache.dtype}")
    checks.check_tensor("slots", call.slots, ndim=1, dtypes=POSITION_DTYPES, device=k.device)
    checks.check_shape("slots", call.slots, (k.shape[0],))
    return checks.kv_scale_args(k.device, k_cache, call.k_scale, call.v_scale)


@takes_arguments_of(RotaryToCacheCall)
def apply_rotary_to_cache_launch(
    *args: Any, **kwargs: Any
) -> tuple[KernelLaunch | None, torch.Tensor]:
    """Checks the arguments and plans the launch `apply_rotary_to_cache` makes."""
    call = RotaryToCacheCall(*args, **kwargs)
    q, k = call.q, call.k
    _check_inputs(q, k, call.positions, call.cos_sin)
    scales = _check_cache_args(call)
    q_out = _new_like(q) if call.q_out is None else call.q_out
    if q.shape[0] == 0:
        return None, q_out
    k_slots = call.k_cache.view(-1, *call.k_cache.shape[2:])
    v_slots = call.v_cache.view(-1, *call.v_cache.shape[2:])
    args = _launch_args(
        q, k, call.v, q_out, k_slots, v_slots, call.positions, call.slots, call.cos_sin, scales
    )
    return _launch(args, q, k, to_cache=True), q_out


@takes_arguments_of(RotaryToCacheCall)
def apply_rotary_to_cache(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Rotates q (into q_out, or q_out=q in place) and writes each token's rotated key and its
    value into its slot of the paged cache; returns q_out. k is left as it was.

    q, k, positions and cos_sin as for `apply_rotary`; v like k; k_cache, v_cache: [num_blocks,
    block_size, num_kv_heads, head_dim] (contiguous, one dtype: k's, another float dtype, or
    float8_e4m3fn with k_scale and v_scale, fp32 tensors of one value: the cache then holds
    k / k_scale and v / v_scale as e4m3, see `reference_math.quantize_kv`); slots: [tokens]
    int32/int64, token i's slot = block * block_size + offset, each in range and distinct (not
    checked: that would sync with the device; a token whose slot is shared with another may leave
    either one's key there).
    """
    launch, q_out = apply_rotary_to_cache_launch(*args, **kwargs)
    if launch is not None:
        launch.run()
    return q_out


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().split(x.shape[-1] // 2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `apply_rotary` (the engine's unfused RotaryEmbedding)."""
    _check_inputs(q, k, positions, cos_sin, kernel=False)
    cos, sin = cos_sin[positions].unsqueeze(1).split(q.shape[2] // 2, dim=-1)
    return _rotate_ref(q, cos, sin), _rotate_ref(k, cos, sin)


@takes_arguments_of(RotaryToCacheCall)
def apply_rotary_to_cache_ref(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Torch version of `apply_rotary_to_cache`: rotary, then index_copy_ of k and v into the cache
    (quantized for an FP8 cache)."""
    call = RotaryToCacheCall(*args, **kwargs)
    _check_cache_args(call)
    q, k = apply_rotary_ref(call.q, call.k, call.positions, call.cos_sin)
    k_cache, v_cache, v, index = call.k_cache, call.v_cache, call.v, call.slots.long()
    if call.k_scale is not None and call.v_scale is not None:
        # The codes copied as bytes (index_copy_ has no float8 kernel on the CPU).
        k_codes, v_codes = quantize_kv(k, call.k_scale), quantize_kv(v, call.v_scale)
        for cache, x in ((k_cache, k_codes), (v_cache, v_codes)):
            cache.view(torch.uint8).view(-1, *x.shape[1:]).index_copy_(
                0, index, x.view(torch.uint8)
            )
    else:
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, index, k.to(k_cache.dtype))
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, index, v.to(v_cache.dtype))
    return q if call.q_out is None else call.q_out.copy_(q)
