"""Log-sum-exp merging of attention states: results over disjoint key sets combined exactly.

Used fused inside the suffix pass of cascade attention, to reduce the prefix pass's splits, and as
a standalone kernel (the unfused fallback).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from prefixgrove_kernels import checks
from prefixgrove_kernels.calls import takes_arguments_of
from prefixgrove_kernels.launch import KernelLaunch
from prefixgrove_kernels.reference_math import merge_states


@triton.jit
def merge_pair(o_a, lse_a, o_b, lse_b):
    """Log-sum-exp merge of two partial results: o_*: [R, D] fp32, lse_*: [R] natural log."""
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m)
    w_b = tl.exp(lse_b - m)
    den = w_a + w_b
    o = (w_a[:, None] * o_a + w_b[:, None] * o_b) / tl.where(den > 0.0, den, 1.0)[:, None]
    return o, tl.where(den > 0.0, m + tl.log(tl.where(den > 0.0, den, 1.0)), float("-inf"))


@triton.jit(do_not_specialize=["num_rows"])  # a per-step count: no recompiles
def reduce_splits_kernel(
    part_o_ptr,  # [NUM_SPLITS, num_rows, HEAD_DIM] fp32, a row is one (token, head)
    part_lse_ptr,  # [NUM_SPLITS, num_rows] fp32
    o_ptr,  # [num_tokens, num_heads, HEAD_DIM] fp32 or the queries' dtype
    lse_ptr,  # [num_rows] fp32 (STORE_LSE only)
    num_rows,
    num_heads,  # (not STORE_LSE only)
    stride_ot,  # (not STORE_LSE only)
    stride_oh,  # (not STORE_LSE only)
    NUM_SPLITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    # True: the merged result is a state for a later merge (o contiguous, lse kept); False: it is
    # the final output (token and head strides of o free, no lse)
    STORE_LSE: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    valid = rows < num_rows
    dims = tl.arange(0, HEAD_DIM)
    o = tl.load(part_o_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None])
    lse = tl.load(part_lse_ptr + rows, mask=valid, other=float("-inf"))
    for split in tl.static_range(1, NUM_SPLITS):
        split_rows = split * num_rows + rows
        o_s = tl.load(
            part_o_ptr + split_rows[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None]
        )
        lse_s = tl.load(part_lse_ptr + split_rows, mask=valid, other=float("-inf"))
        o, lse = merge_pair(o, lse, o_s, lse_s)
    if STORE_LSE:
        o_offs = rows * HEAD_DIM
        tl.store(lse_ptr + rows, lse, mask=valid)
    else:
        o_offs = (rows // num_heads) * stride_ot + (rows % num_heads) * stride_oh
    tl.store(
        o_ptr + o_offs[:, None] + dims[None, :], o.to(o_ptr.dtype.element_ty), mask=valid[:, None]
    )


def reduce_splits_launch(
    part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor | None
) -> KernelLaunch:
    """Plans the merge of the splits' partial states into `out` (and `out_lse` when given, with a
    contiguous `out`). part_o: [num_splits, num_tokens, num_heads, head_dim] fp32; part_lse:
    [num_splits, num_tokens, num_heads] fp32; out: [num_tokens, num_heads, head_dim]."""
    num_splits, num_tokens, num_heads, head_dim = part_o.shape
    num_rows = num_tokens * num_heads
    lse = out_lse if out_lse is not None else part_lse  # unused without out_lse
    args = (part_o, part_lse, out, lse, num_rows, num_heads, out.stride(0), out.stride(1))
    options = {
        "NUM_SPLITS": num_splits,
        "BLOCK_R": 16,
        "HEAD_DIM": head_dim,
        "STORE_LSE": out_lse is not None,
    }
    return KernelLaunch(reduce_splits_kernel, (triton.cdiv(num_rows, 16),), args, options)


@triton.jit(do_not_specialize=["num_rows"])  # a per-step count: no recompiles
def _merge_states_kernel(
    o_a_ptr,  # o_*: [num_rows, HEAD_DIM], a row is one (token, head)
    lse_a_ptr,  # lse_*: [num_rows] fp32
    o_b_ptr,
    lse_b_ptr,
    o_ptr,
    lse_ptr,
    num_rows,
    BLOCK_R: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < num_rows
    offs = rows.to(tl.int64)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o_a = tl.load(o_a_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
    o_b = tl.load(o_b_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
    lse_a = tl.load(lse_a_ptr + rows, mask=valid, other=float("-inf"))
    lse_b = tl.load(lse_b_ptr + rows, mask=valid, other=float("-inf"))
    o, lse = merge_pair(o_a, lse_a, o_b, lse_b)
    tl.store(o_ptr + offs, o.to(o_ptr.dtype.element_ty), mask=valid[:, None])
    tl.store(lse_ptr + rows, lse, mask=valid)


def _check_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> None:
    checks.check_tensor("o_a", o_a, ndim=3, dtypes=checks.ATTENTION_DTYPES, device=o_a.device)
    checks.check_output("o_b", o_b, o_a, o_a.dtype)
    checks.check_lse("lse_a", lse_a, o_a)
    checks.check_lse("lse_b", lse_b, o_a)
    if not checks.is_power_of_two(o_a.shape[2]):
        raise ValueError(f"head_dim {o_a.shape[2]} must be a power of two")


def merge_attention_states_launch(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[KernelLaunch | None, torch.Tensor, torch.Tensor]:
    """Checks the arguments and plans the launch `merge_attention_states` makes."""
    _check_states(o_a, lse_a, o_b, lse_b)
    out = torch.empty_like(o_a) if out is None else out
    out_lse = torch.empty_like(lse_a) if out_lse is None else out_lse
    checks.check_output("out", out, o_a, o_a.dtype)
    checks.check_lse("out_lse", out_lse, o_a)
    num_rows = o_a.shape[0] * o_a.shape[1]
    if num_rows == 0:
        return None, out, out_lse
    args = (o_a, lse_a, o_b, lse_b, out, out_lse, num_rows)
    options = {"BLOCK_R": 16, "HEAD_DIM": o_a.shape[2]}
    return (
        KernelLaunch(_merge_states_kernel, (triton.cdiv(num_rows, 16),), args, options),
        out,
        out_lse,
    )


@takes_arguments_of(merge_attention_states_launch)
def merge_attention_states(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from the results over each.

    o_a, o_b: [num_tokens, num_heads, head_dim] (same dtype); lse_a, lse_b: [num_tokens,
    num_heads] fp32, natural log, -inf for an empty key set. Returns (o, lse); o has o_a's dtype.
    """
    launch, out, out_lse = merge_attention_states_launch(*args, **kwargs)
    if launch is not None:
        launch.run()
    return out, out_lse


def merge_attention_states_ref(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `merge_attention_states`."""
    _check_states(o_a, lse_a, o_b, lse_b)
    o, lse = merge_states(o_a, lse_a, o_b, lse_b)
    return o.to(o_a.dtype), lse
