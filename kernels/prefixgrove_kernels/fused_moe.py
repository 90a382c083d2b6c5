"""A mixture-of-experts MLP in two grouped GEMMs over all experts: each token through its top-k
experts, silu(x @ gate.T) * (x @ up.T) @ down.T, weighted by its routing weights and summed.

1. `moe_align` sorts the (token, choice) pairs by expert into runs padded to BLOCK_M rows.
2. One grouped GEMM for gate/up: a program takes one block of one expert's pairs (their tokens' rows
   of x) and BLOCK_N columns of both the gate and the up half of the expert's w_gate_up, and writes
   silu(gate) * up: h [pairs, N].
3. One grouped GEMM for down: rows of h through the expert's w_down, times the pair's routing weight,
   written to [pairs, K]; a small kernel then sums each token's top_k rows in fp32.

Rounding follows transformers' experts loop (`Qwen3MoeExperts.forward`), which `fused_moe_reference`
is: each linear's output is rounded to x's dtype, silu and the product as `activation.silu_and_mul`,
the routing weight multiplied in fp32 and rounded again. transformers adds the experts' rows one by
one in x's dtype; the sum kernel adds a token's rows in fp32, in choice order, and rounds once.

FP8 experts (W8A8): w_gate_up and w_down in e4m3 with float32 scales per expert and output channel
([E, rows]; [E] or [E, 1] for one per expert). The activations are quantized per row on the way in
(`fp8_quant.quantize_rows`: x per token, h per pair), the dots run on the e4m3 codes with fp32
accumulation, and the epilogue multiplies by the row's scale, then the channel's. With block scales
(128x128 weight blocks, `fp8_block`) the scales are [E, rows, ceil(K / 128)], one per expert, row
and 128-column group (each block's repeated over its rows), the activations are quantized per row
and group (`fp8_block.quantize_groups`), and each K step (at most one group) scales its dot by the
row's and the column's scale of its group before it joins the fp32 accumulator.

Tensor parallelism of experts needs nothing here: a rank passes its slice of every expert's
intermediate columns (w_gate_up [E, 2 * N / ranks, K], the rank's gate rows then its up rows;
w_down [E, K, N / ranks]) with the whole x and routing, and gets a partial sum [tokens, K] that
one all-reduce after the layer completes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from prefixgrove_kernels import checks
from prefixgrove_kernels.calls import takes_arguments_of
from prefixgrove_kernels.checks import FP8_KV_DTYPE
from prefixgrove_kernels.fp8_block import (
    GROUP,
    block_scaled_mm_ref,
    groups_of,
    quantize_groups_launch,
    quantize_groups_ref,
)
from prefixgrove_kernels.fp8_quant import quantize_rows_launch, quantize_rows_ref
from prefixgrove_kernels.launch import KernelLaunch
from prefixgrove_kernels.moe_align import MoeAlignment, moe_align_launches
from prefixgrove_kernels.moe_configs import MoeTileConfig, moe_shape, tile_config
from prefixgrove_kernels.paged_attention import dot_precision

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ID_DTYPES = (torch.int32, torch.int64)
SUM_TILE = 4096  # elements per program of the sum over each token's choices (tokens x columns)


@triton.jit
def _dot(a, b, acc, FP8: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a @ b in fp32; e4m3 operands take no input precision (it names fp32's)."""
    if FP8:
        return tl.dot(a, b, acc)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # gate/up: x [tokens, K]; down: h [pairs, K] (row stride free; e4m3 when FP8)
    a_scale_ptr,  # FP8: [rows of a] fp32; BLOCK_SCALED: [rows of a, groups]
    b_ptr,  # gate/up: w_gate_up [E, 2 * N, K] (gate rows, then up rows); down: w_down [E, N, K]
    b_scale_ptr,  # FP8: [E, rows of b] fp32 (channel stride 0: one per expert); [E, rows, groups]
    out_ptr,  # [pairs, N] (row stride free)
    pair_weights_ptr,  # ROUTED_WEIGHT: [pairs] routing weights
    sorted_ptr,  # [max_blocks * BLOCK_M] int32: pairs by expert, padding = num_pairs
    block_experts_ptr,  # [max_blocks] int32
    num_padded_ptr,  # [1] int32
    N,
    K,
    num_pairs,
    stride_am,
    stride_be,
    stride_bn,
    stride_om,
    stride_se,
    stride_sn,
    stride_asm,  # BLOCK_SCALED: a_scale's row stride (its groups are contiguous, as b_scale's)
    PAIRS_PER_A_ROW: tl.constexpr,  # top_k for gate/up (a row of x is a token), 1 for down
    SILU_MUL: tl.constexpr,  # gate/up's epilogue
    ROUTED_WEIGHT: tl.constexpr,  # down's epilogue
    FP8: tl.constexpr,
    BLOCK_SCALED: tl.constexpr,  # FP8 with block scales; BLOCK_K then divides SCALE_GROUP
    SCALE_GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # GROUP_M row blocks walk the column blocks together, so their weight tiles meet in L2.
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(N, BLOCK_N)
    blocks_m = tl.num_programs(0) // blocks_n
    first_m = (pid // (GROUP_M * blocks_n)) * GROUP_M
    group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * blocks_n)) % group_rows
    pid_n = (pid % (GROUP_M * blocks_n)) // group_rows
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    # pairs: [BLOCK_M] of one expert; cols: [BLOCK_N] output columns
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    live = pairs < num_pairs
    a_rows = (pairs // PAIRS_PER_A_ROW).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
    # b tile: [BLOCK_K, BLOCK_N], the expert's rows `cols` read along K
    b_ptrs = b_ptr + expert * stride_be + cols.to(tl.int64)[None, :] * stride_bn + ks[:, None]
    up_offset = N.to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    a_scale_rows = a_scale_ptr + a_rows * stride_asm
    b_scale_cols = b_scale_ptr + expert * stride_se + cols * stride_sn
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if BLOCK_SCALED:  # this step's group: its dot scaled by the row's and the column's scale
            group = k0 // SCALE_GROUP
            a_scale = tl.load(a_scale_rows + group, mask=live, other=0.0)[:, None]
            b_scale = tl.load(b_scale_cols + group, mask=col_ok, other=0.0)[None, :]
            acc += tl.dot(a, b) * a_scale * b_scale
            if SILU_MUL:
                b_up = tl.load(b_ptrs + up_offset, mask=b_mask, other=0.0)
                up_scale = tl.load(b_scale_cols + N * stride_sn + group, mask=col_ok, other=0.0)
                acc_up += tl.dot(a, b_up) * a_scale * up_scale[None, :]
        else:
            acc = _dot(a, b, acc, FP8, DOT_PRECISION)
            if SILU_MUL:
                b_up = tl.load(b_ptrs + up_offset, mask=b_mask, other=0.0)
                acc_up = _dot(a, b_up, acc_up, FP8, DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if FP8 and not BLOCK_SCALED:
        a_scale = tl.load(a_scale_ptr + a_rows, mask=live, other=0.0)
        scale_ptrs = b_scale_ptr + expert * stride_se + cols * stride_sn
        acc = acc * a_scale[:, None] * tl.load(scale_ptrs, mask=col_ok, other=0.0)[None, :]
        if SILU_MUL:
            up_scale = tl.load(scale_ptrs + N * stride_sn, mask=col_ok, other=0.0)
            acc_up = acc_up * a_scale[:, None] * up_scale[None, :]
    out_ty = out_ptr.dtype.element_ty
    # each linear's output rounded to the output dtype, as the unfused layers store it
    result = acc.to(out_ty)
    if SILU_MUL:
        gate = result.to(tl.float32)
        # NOTE: IEEE division (not Triton's approximate `/`), as torch's silu divides.
        silu = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(out_ty)
        result = (silu.to(tl.float32) * acc_up.to(out_ty).to(tl.float32)).to(out_ty)
    if ROUTED_WEIGHT:
        weight = tl.load(pair_weights_ptr + pairs, mask=live, other=0.0).to(tl.float32)
        result = (result.to(tl.float32) * weight[:, None]).to(out_ty)
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, result, mask=live[:, None] & col_ok[None, :])


@triton.jit
def _sum_choices_kernel(
    y_ptr,  # [tokens * TOP_K, K]: each pair's weighted row, a token's TOP_K rows together
    out_ptr,  # [tokens, K]
    tokens,
    K,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < tokens)[:, None] & (cols < K)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        y = tl.load(y_ptr + (rows * TOP_K + j)[:, None] * K + cols[None, :], mask=mask, other=0.0)
        acc += y.to(tl.float32)
    tl.store(
        out_ptr + rows[:, None] * K + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask
    )


class Operand(NamedTuple):
    values: torch.Tensor  # activations [rows, K] or expert weights [E, rows, K]
    # FP8, float32: activations [rows]; weights [E, rows] or [E, 1]. Block scales: activations
    # [rows, groups], weights [E, rows, groups]
    scale: torch.Tensor | None


def _check_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    scales: tuple[torch.Tensor | None, torch.Tensor | None],
) -> bool:
    """Checks x [tokens, K] against w_gate_up [E, 2N, K] and w_down [E, K, N] (in x's dtype, or
    e4m3 with both scales); returns whether the experts are FP8."""
    checks.check_tensor("x", x, ndim=2, dtypes=ACTIVATION_DTYPES, device=x.device, contiguous=False)
    checks.check_unit_last_stride("x", x)
    weight_dtypes = (x.dtype, FP8_KV_DTYPE)
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        checks.check_tensor(
            name, w, ndim=3, dtypes=weight_dtypes, device=x.device, contiguous=False
        )
        checks.check_unit_last_stride(name, w)
    if w_down.dtype != w_gate_up.dtype:
        raise TypeError(f"w_down is {w_down.dtype} but w_gate_up is {w_gate_up.dtype}")
    experts, rows, hidden = w_gate_up.shape
    if rows % 2 != 0 or hidden != x.shape[1]:
        raise ValueError(
            f"w_gate_up must be [E, 2 * N, {x.shape[1]}] (gate rows, then up rows), got "
            f"{tuple(w_gate_up.shape)}"
        )
    checks.check_shape("w_down", w_down, (experts, hidden, rows // 2))
    fp8 = w_gate_up.dtype == FP8_KV_DTYPE
    if [scale is not None for scale in scales] != [fp8, fp8]:
        raise ValueError(
            "FP8 experts (float8_e4m3fn) take both w_gate_up_scale and w_down_scale; experts in "
            f"x's dtype take neither (experts: {w_gate_up.dtype})"
        )
    return fp8


def _check_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, x: torch.Tensor) -> None:
    checks.check_tensor("topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES, device=x.device)
    weight_dtypes = (torch.float32, x.dtype)
    checks.check_tensor("topk_weights", topk_weights, ndim=2, dtypes=weight_dtypes, device=x.device)
    checks.check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids routes {topk_ids.shape[0]} tokens but x has {x.shape[0]}")


def _expert_scale(name: str, scale: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An FP8 expert weight's scales as [E, rows] or [E, 1] float32, or block scales as
    [E, rows, groups] (a 3-dimensional scale)."""
    experts, rows, columns = w.shape
    checks.check_tensor(name, scale, ndim=scale.dim(), dtypes=(torch.float32,), device=w.device)
    if scale.dim() == 3:
        checks.check_shape(name, scale, (experts, rows, groups_of(columns)))
        return scale.contiguous()
    if scale.numel() not in (experts, experts * rows):
        raise ValueError(
            f"{name} must hold one scale per expert and output channel {(experts, rows)} or one "
            f"per expert ({experts},), got {tuple(scale.shape)}"
        )
    return scale.reshape(experts, -1)


def _rows_in(t: torch.Tensor, fp8: bool, blocks: bool) -> tuple[Operand, list[KernelLaunch]]:
    """Activations as the GEMM takes them: as they are, or quantized per row (per row and group
    for block-scaled experts) for FP8 experts, with the launch that quantizes them."""
    if not fp8:
        return Operand(t, None), []
    if blocks:
        launch, codes, scale = quantize_groups_launch(t)
    else:
        launch, codes, scale = quantize_rows_launch(t)
        scale = scale.view(-1)
    return Operand(codes, scale), [launch] if launch is not None else []


def _expert_operands(
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    w_gate_up_scale: torch.Tensor | None,
    w_down_scale: torch.Tensor | None,
) -> tuple[Operand, Operand]:
    if w_gate_up_scale is None or w_down_scale is None:
        return Operand(w_gate_up, None), Operand(w_down, None)
    if (w_gate_up_scale.dim() == 3) != (w_down_scale.dim() == 3):
        raise ValueError(
            "w_gate_up_scale and w_down_scale must both be block scales [E, rows, groups] or "
            f"neither, got {tuple(w_gate_up_scale.shape)} and {tuple(w_down_scale.shape)}"
        )
    return (
        Operand(w_gate_up, _expert_scale("w_gate_up_scale", w_gate_up_scale, w_gate_up)),
        Operand(w_down, _expert_scale("w_down_scale", w_down_scale, w_down)),
    )


def _gemm_launch(
    a: Operand, b: Operand, out: torch.Tensor, align: MoeAlignment, tiles: MoeTileConfig, *,
    pairs_per_a_row: int, pair_weights: torch.Tensor | None = None,
) -> KernelLaunch:  # fmt: skip
    """`_moe_gemm_kernel` over every block of `align`: gate/up when pair_weights is None (b has
    twice out's columns as rows), down otherwise."""
    n, k = out.shape[1], a.values.shape[1]
    a_scale = a.scale if a.scale is not None else out
    b_scale = b.scale if b.scale is not None else out
    per_channel = b.scale is not None and b.scale.shape[1] > 1
    blocks = b.scale is not None and b.scale.dim() == 3
    args = (
        a.values, a_scale, b.values, b_scale, out,
        pair_weights if pair_weights is not None else out, *align[:3], n, k, out.shape[0],
        a.values.stride(0), b.values.stride(0), b.values.stride(1), out.stride(0),
        b_scale.stride(0), b_scale.stride(1) if per_channel else 0,
        a_scale.stride(0) if blocks else 0,
    )  # fmt: skip
    options = {
        "PAIRS_PER_A_ROW": pairs_per_a_row, "SILU_MUL": pair_weights is None,
        "ROUTED_WEIGHT": pair_weights is not None, "FP8": a.scale is not None,
        "BLOCK_SCALED": blocks, "SCALE_GROUP": GROUP,
        "DOT_PRECISION": dot_precision(a.values.dtype), **tiles.launch_options(),
    }  # fmt: skip
    grid = (align.block_experts.shape[0] * triton.cdiv(n, tiles.block_n),)
    return KernelLaunch(_moe_gemm_kernel, grid, args, options)


def _sum_launch(y: torch.Tensor, out: torch.Tensor, top_k: int) -> KernelLaunch:
    tokens, hidden = out.shape
    block_k = min(SUM_TILE, triton.next_power_of_2(hidden))
    block_t = min(SUM_TILE // block_k, triton.next_power_of_2(tokens))
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(hidden, block_k))
    options = {"TOP_K": top_k, "BLOCK_T": block_t, "BLOCK_K": block_k, "num_warps": 4}
    return KernelLaunch(_sum_choices_kernel, grid, (y, out, tokens, hidden), options)


def fused_moe_launches(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: MoeTileConfig | None = None,
    *,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
) -> tuple[list[KernelLaunch], torch.Tensor]:
    """Checks the arguments and plans the launches `fused_moe` makes, in order; returns them with
    the output they fill."""
    fp8 = _check_experts(x, w_gate_up, w_down, (w_gate_up_scale, w_down_scale))
    _check_routing(topk_ids, topk_weights, x)
    gate_up, down = _expert_operands(w_gate_up, w_down, w_gate_up_scale, w_down_scale)
    (tokens, top_k), (experts, hidden, n) = topk_ids.shape, w_down.shape
    out = x.new_empty((tokens, hidden))
    if tokens == 0:
        return [], out
    tiles = config or tile_config(moe_shape(x, w_gate_up), tokens)
    blocks = gate_up.scale is not None and gate_up.scale.dim() == 3
    if blocks:  # a K step within one scale group
        tiles = replace(tiles, block_k=min(tiles.block_k, GROUP))
    launches, align = moe_align_launches(topk_ids, experts, tiles.block_m)
    h, y = x.new_empty((tokens * top_k, n)), x.new_empty((tokens * top_k, hidden))
    x_in, quantize_x = _rows_in(x, fp8, blocks)
    h_in, quantize_h = _rows_in(h, fp8, blocks)
    weights = topk_weights.view(-1)
    return [
        *launches,
        *quantize_x,
        _gemm_launch(x_in, gate_up, h, align, tiles, pairs_per_a_row=top_k),
        *quantize_h,
        _gemm_launch(h_in, down, y, align, tiles, pairs_per_a_row=1, pair_weights=weights),
        _sum_launch(y, out, top_k),
    ], out


@takes_arguments_of(fused_moe_launches)
def fused_moe(*args: Any, **kwargs: Any) -> torch.Tensor:
    """x [tokens, K] through experts w_gate_up [E, 2N, K] and w_down [E, K, N] as routed by
    topk_ids [tokens, top_k] (int32/int64, distinct per token) and topk_weights [tokens, top_k]
    (float32 or x's dtype) -> [tokens, K] in x's dtype. config: the tiles (default: the table's,
    `moe_configs.tile_config`). FP8 experts (e4m3) take their float32 scales by keyword."""
    launches, out = fused_moe_launches(*args, **kwargs)
    for launch in launches:
        launch.run()
    return out


def _linear_ref(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None) -> torch.Tensor:
    """a @ w.T in a's dtype; FP8 weights (with their scales [rows] or [1]): a quantized per row,
    the codes multiplied in fp32, then the row's scale and the channel's; block-scaled (scales
    [rows, groups]): a quantized per row and group, both sides dequantized and multiplied in fp32."""
    if w_scale is None:
        return F.linear(a, w)
    if w_scale.dim() == 2:
        return block_scaled_mm_ref(*quantize_groups_ref(a), w, w_scale, a.dtype)
    codes, a_scale = quantize_rows_ref(a)
    return ((codes.float() @ w.float().T) * a_scale * w_scale.view(1, -1)).to(a.dtype)


def fused_moe_reference(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch version of `fused_moe`: transformers' experts loop (`Qwen3MoeExperts.forward`), one
    expert after another in id order, each adding its weighted rows in x's dtype."""
    _check_experts(x, w_gate_up, w_down, (w_gate_up_scale, w_down_scale))
    _check_routing(topk_ids, topk_weights, x)
    gate_up, down = _expert_operands(w_gate_up, w_down, w_gate_up_scale, w_down_scale)
    out = torch.zeros_like(x)
    for expert in topk_ids.unique().tolist():
        gate_up_scale = gate_up.scale[expert] if gate_up.scale is not None else None
        down_scale = down.scale[expert] if down.scale is not None else None
        slot, token = torch.where(topk_ids.T.eq(expert))
        gate, up = _linear_ref(x[token], w_gate_up[expert], gate_up_scale).chunk(2, dim=-1)
        y = _linear_ref(F.silu(gate) * up, w_down[expert], down_scale)
        y = y * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
