"""Block-scaled FP8 products, the layout of DeepSeek-V3's and Qwen3's FP8 checkpoints: a weight
[N, K] in e4m3 with one float32 scale per 128x128 block, activations quantized per token and per
128-column group (each group's amax / 448), and the product summed group by group in fp32:

    out[m, n] = sum_g (a_g[m] . w_g[n]) * a_scale[m, g] * w_scale[n, g]

Weight scales come in either of two forms: one per block, [ceil(N / 128), ceil(K / 128)] (as the
checkpoints store `weight_scale_inv`), or one per row and group, [N, ceil(K / 128)] (each block's
scale repeated over its rows), which is how the engine keeps a fused matrix whose parts (q, k, v)
do not each fill whole blocks of rows. The last group of a row and the last block of a matrix may
be partial (K or N not a multiple of 128).

`quantize_groups` writes the activations' codes and scales by the rule `fp8_quant.row_scale` gives
every per-row quantization, applied to each group; `block_scaled_mm` is one Triton GEMM whose
K-step is a group, so each step's e4m3 dot is scaled by its two scales before it joins the fp32
accumulator. Triton's interpreter multiplies e4m3 tiles exactly, so the CPU tests run the kernels
themselves; the torch references (`*_ref`) dequantize and multiply in fp32.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import triton
import triton.language as tl

from prefixgrove_kernels import checks
from prefixgrove_kernels.calls import takes_arguments_of
from prefixgrove_kernels.checks import FP8_KV_DTYPE, FP8_MAX, MIN_SCALE
from prefixgrove_kernels.fp8_quant import INPUT_DTYPES, ROW_SCALE_OPTIONS, row_scale
from prefixgrove_kernels.launch import KernelLaunch
from prefixgrove_kernels.reference_math import to_e4m3_ref
from prefixgrove_kernels.rotary import to_e4m3

GROUP = 128  # columns per activation group; a weight block is GROUP x GROUP
OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


logger = logging.getLogger(__name__)
_QUANT_ROWS = 16
NATIVE_ROWS = 4  # torch's blockwise GEMM takes a multiple of this many rows
# and of this many 128-column blocks: with 3 it returned wrong sums on an H200 (cuBLAS, CUDA 13)
NATIVE_K_BLOCKS = 4


def groups_of(columns: int) -> int:
    """Groups (or blocks) along `columns`, the last one partial where GROUP does not divide it."""
    return -(-columns // GROUP)


@triton.jit
def _quantize_groups_kernel(
    x_ptr,  # [rows, C] input (row stride free)
    q_ptr,  # [rows, C] e4m3 out
    scale_ptr,  # [rows, G] fp32 out
    R,
    C,
    x_stride,
    q_stride,
    scale_stride,
    scale_group_stride,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,  # rows a program takes: one group of 128 columns of each
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    row_ok = rows < R
    inside = row_ok[:, None] & (cols < C)[None, :]
    r = rows.to(tl.int64)
    x = tl.load(x_ptr + r[:, None] * x_stride + cols[None, :], mask=inside, other=0.0)
    x = x.to(tl.float32)
    scale = row_scale(tl.max(tl.abs(x), axis=1), FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + r * scale_stride + group * scale_group_stride, scale, mask=row_ok)
    q = to_e4m3(x, scale[:, None])
    tl.store(q_ptr + r[:, None] * q_stride + cols[None, :], q, mask=inside)


def _check_activations(x: torch.Tensor) -> None:
    checks.check_tensor("x", x, ndim=2, dtypes=INPUT_DTYPES, device=x.device, contiguous=False)
    checks.check_unit_last_stride("x", x)


def quantize_groups_launch(
    x: torch.Tensor, pad_rows_to: int = 1, group_major: bool = False
) -> tuple[KernelLaunch | None, torch.Tensor, torch.Tensor]:
    """Checks the argument and plans the launch `quantize_groups` makes, with the outputs it fills."""
    _check_activations(x)
    rows, cols = x.shape
    padded = -(-rows // pad_rows_to) * pad_rows_to
    q = torch.empty((padded, cols), dtype=FP8_KV_DTYPE, device=x.device)
    groups = groups_of(cols)
    if group_major:  # [rows, G] whose rows are contiguous: stored as [G, rows]
        scale = torch.empty((groups, padded), dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty((padded, groups), dtype=torch.float32, device=x.device)
    if rows == 0 or cols == 0:
        return None, q, scale
    args = (x, q, scale, rows, cols, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1))
    # a [16, 128] tile a program: one (row, group) each left the GPU mostly launching programs
    block = min(_QUANT_ROWS, triton.next_power_of_2(rows))
    options = {**ROW_SCALE_OPTIONS, "GROUP": GROUP, "ROWS": block, "num_warps": 4}
    grid = (triton.cdiv(rows, block), groups)
    return KernelLaunch(_quantize_groups_kernel, grid, args, options), q, scale


def quantize_groups(
    x: torch.Tensor, pad_rows_to: int = 1, group_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, C] -> (e4m3 values [rows, C], float32 scales [rows, ceil(C / 128)]): each row's
    group g of 128 columns stands for values[:, g] * scales[:, g]. `pad_rows_to`: both outputs
    rounded up to a multiple of that many rows, the added rows left unwritten (a GEMM's rows are
    independent: their results are dropped); `group_major`: the scales stored group by group (rows
    contiguous), as torch's blockwise-scaled GEMM reads them."""
    launch, q, scale = quantize_groups_launch(x, pad_rows_to, group_major)
    if launch is not None:
        launch.run()
    return q, scale


def _padded_groups(x: torch.Tensor) -> torch.Tensor:
    """x [rows, C] as [rows, G, 128] in fp32, the last group zero-padded (zeros leave amax as is)."""
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, groups_of(cols) * GROUP - cols))
    return padded.view(rows, -1, GROUP)


def quantize_groups_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `quantize_groups` (the engine's path on the CPU): the same bytes."""
    _check_activations(x)
    groups = _padded_groups(x)
    scale = (groups.abs().amax(dim=-1) / FP8_MAX).clamp_min(MIN_SCALE)
    return to_e4m3_ref(x, expand_group_scales(scale, x.shape[1])), scale


def expand_group_scales(scale: torch.Tensor, columns: int) -> torch.Tensor:
    """Scales [..., G] -> one per column [..., columns]."""
    return scale.repeat_interleave(GROUP, dim=-1)[..., :columns]


def row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """Weight scales in either form -> one per row and group, [rows, G] (float32)."""
    scale = scale.float()
    if scale.shape[0] == rows:
        return scale
    if scale.shape[0] != groups_of(rows):
        raise ValueError(
            f"weight scales {tuple(scale.shape)} fit neither {rows} rows nor their "
            f"{groups_of(rows)} blocks of {GROUP}"
        )
    return scale.repeat_interleave(GROUP, dim=0)[:rows]


def quantize_blocks_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 codes [N, K], float32 scales [ceil(N / 128), ceil(K / 128)]): each
    128x128 block under its own scale, max(amax / 448, MIN_SCALE) (load-time quantization)."""
    rows, cols = w.shape
    blocks = _padded_groups(w)  # [N, G, 128]
    blocks = torch.nn.functional.pad(blocks, (0, 0, 0, 0, 0, groups_of(rows) * GROUP - rows))
    amax = blocks.abs().view(-1, GROUP, blocks.shape[1], GROUP).amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp_min(MIN_SCALE)
    return to_e4m3_ref(w, _per_element(scale, rows, cols)), scale


def _per_element(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return expand_group_scales(row_scales(scale, rows), cols)


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A weight's codes [N, K] times its scales (either form), in float32."""
    return codes.float() * _per_element(scale, *codes.shape)


@triton.jit
def _block_scaled_mm_kernel(
    a_ptr,  # [M, K] e4m3 (row stride free)
    a_scale_ptr,  # [M, G] fp32
    b_ptr,  # [N, K] e4m3 (row stride free)
    b_scale_ptr,  # [N / ROWS_PER_SCALE, G] fp32
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_om,
    ROWS_PER_SCALE: tl.constexpr,  # 1: a scale per row and group; GROUP: one per block
    GROUP: tl.constexpr,  # the K step: one activation group, one column of weight blocks
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    ks = tl.arange(0, GROUP)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :]
    # b tile: [GROUP, BLOCK_N], rows `cols` of the weight read along K
    b_ptrs = b_ptr + cols.to(tl.int64)[None, :] * stride_bn + ks[:, None]
    a_scale_ptrs = a_scale_ptr + rows.to(tl.int64) * stride_asm
    b_scale_ptrs = b_scale_ptr + (cols // ROWS_PER_SCALE).to(tl.int64) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for group in range(0, tl.cdiv(K, GROUP)):
        k_ok = ks < K - group * GROUP
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        part = tl.dot(a, b, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
        a_scale = tl.load(a_scale_ptrs + group, mask=row_ok, other=0.0)
        b_scale = tl.load(b_scale_ptrs + group, mask=col_ok, other=0.0)
        acc += part * a_scale[:, None] * b_scale[None, :]
        a_ptrs += GROUP
        b_ptrs += GROUP
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _check_product(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
) -> int:
    """Checks the operands; returns the rows each weight scale covers (1 or GROUP)."""
    for name, t in (("a", a), ("w", w)):
        checks.check_tensor(
            name, t, ndim=2, dtypes=(FP8_KV_DTYPE,), device=a.device, contiguous=False
        )
        checks.check_unit_last_stride(name, t)
    (m, k), (n, k_w) = a.shape, w.shape
    if k != k_w:
        raise ValueError(f"a has {k} columns but w has {k_w}: expected w [N, {k}]")
    groups = groups_of(k)
    for name, t in (("a_scale", a_scale), ("w_scale", w_scale)):
        checks.check_tensor(
            name, t, ndim=2, dtypes=(torch.float32,), device=a.device, contiguous=False
        )
        checks.check_unit_last_stride(name, t)
    checks.check_shape("a_scale", a_scale, (m, groups))
    if tuple(w_scale.shape) not in ((n, groups), (groups_of(n), groups)):
        raise ValueError(
            f"w_scale must be [{n}, {groups}] (per row and group) or [{groups_of(n)}, {groups}] "
            f"(per {GROUP}x{GROUP} block), got {tuple(w_scale.shape)}"
        )
    return 1 if w_scale.shape[0] == n else GROUP


def block_scaled_mm_launch(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> tuple[KernelLaunch | None, torch.Tensor]:
    """Checks the arguments and plans the launch `block_scaled_mm` makes, with the output it fills."""
    rows_per_scale = _check_product(a, a_scale, w, w_scale)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype {out_dtype} is not one of {OUT_DTYPES}")
    (m, k), n = a.shape, w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return None, out
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    block_n = 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    args = (a, a_scale, w, w_scale, out, m, n, k, a.stride(0), a_scale.stride(0), w.stride(0),
            w_scale.stride(0), out.stride(0))  # fmt: skip
    options = {"ROWS_PER_SCALE": rows_per_scale, "GROUP": GROUP, "BLOCK_M": block_m,
               "BLOCK_N": block_n, "num_warps": 4, "num_stages": 3}  # fmt: skip
    return KernelLaunch(_block_scaled_mm_kernel, grid, args, options), out


@takes_arguments_of(block_scaled_mm_launch)
def block_scaled_mm(*args: Any, **kwargs: Any) -> torch.Tensor:
    """a [M, K] e4m3 with group scales [M, ceil(K / 128)] (`quantize_groups`) times w [N, K] e4m3
    with block scales (either form) transposed -> [M, N] in out_dtype, accumulated in fp32."""
    launch, out = block_scaled_mm_launch(*args, **kwargs)
    if launch is not None:
        launch.run()
    return out


def block_scaled_mm_ref(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Torch version of `block_scaled_mm`: both sides dequantized, multiplied in fp32."""
    _check_product(a, a_scale, w, w_scale)
    x = a.float() * expand_group_scales(a_scale, a.shape[1])
    return (x @ dequantize_blocks(w, w_scale).T).to(out_dtype)


def whole_block_scales(scale: torch.Tensor) -> torch.Tensor | None:
    """Per-row weight scales [N, G] as one scale per 128x128 block [N / 128, G], where every
    block of 128 rows shares its scales (N a multiple of 128, and a fused matrix whose parts fill
    whole blocks); None otherwise."""
    rows = scale.shape[0]
    if rows % GROUP:
        return None
    blocks = scale[::GROUP].contiguous()
    return blocks if torch.equal(blocks.repeat_interleave(GROUP, dim=0), scale) else None


def block_scaled_mm_native(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_blocks: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`block_scaled_mm` through torch's own blockwise-scaled GEMM (cuBLAS on Hopper, CUDA 12.9
    and later): a's 1x128 group scales and w's 128x128 block scales [N / 128, K / 128], both
    read by the GEMM itself. cuBLAS wants a's scales group-major (`quantize_groups(x,
    NATIVE_ROWS, group_major=True)`: rows contiguous, their count a multiple of NATIVE_ROWS, so
    that each group's column starts 16 bytes aligned), and answers in bf16 only."""
    if a.shape[1] % (NATIVE_K_BLOCKS * GROUP):
        raise ValueError(
            f"a has {a.shape[1]} columns: torch's blockwise GEMM takes multiples of "
            f"{NATIVE_K_BLOCKS * GROUP}"
        )
    if a.shape[0] == 0:  # cuBLAS takes no empty product
        return torch.empty((0, w.shape[0]), dtype=out_dtype, device=a.device)
    if a.shape[0] % NATIVE_ROWS or a_scale.stride(0) != 1:
        raise ValueError(
            f"a [{a.shape[0]}, ...] and its scales must be quantize_groups(x, {NATIVE_ROWS}, "
            f"group_major=True)'s: rows a multiple of {NATIVE_ROWS}, scales group-major"
        )
    out = torch._scaled_mm(
        a, w.t(), scale_a=a_scale, scale_b=w_blocks.t(), out_dtype=torch.bfloat16
    )
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


_NATIVE: dict[torch.device, bool] = {}


def native_block_scaled_mm_works(device: torch.device) -> bool:
    """Whether `block_scaled_mm_native` runs on `device` and gives the exact sums within the
    tensor cores' error (this torch, CUDA and GPU offering the blockwise scaling), checked once per device
    at a few row counts; never while a CUDA graph is being captured (answers False then)."""
    if device not in _NATIVE:
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return False
        _NATIVE[device] = _native_matches(device)
    return _NATIVE[device]


def _native_matches(device: torch.device) -> bool:
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(256, 512, device=device, generator=gen)
    w_codes, w_blocks = quantize_blocks_ref(w)
    for rows in (1, 5, 128):
        x = torch.randn(rows, 512, device=device, generator=gen)
        a, a_scale = quantize_groups(x, NATIVE_ROWS, group_major=True)
        try:
            got = block_scaled_mm_native(a, a_scale, w_codes, w_blocks, torch.float32)
        except RuntimeError as error:  # no blockwise scaling in this torch or on this GPU
            logger.info("torch's blockwise-scaled GEMM does not run here (%s): Triton's", error)
            return False
        a, a_scale = a[:rows], a_scale[:rows].contiguous()  # the rows asked for
        want = block_scaled_mm_ref(a, a_scale, w_codes, w_blocks, torch.float32)
        if ((got[:rows] - want).abs() > accumulation_bound(a, a_scale, w_codes, w_blocks)).any():
            logger.warning("torch's blockwise-scaled GEMM misses the exact sums here: Triton's")
            return False
    return True


def accumulation_bound(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """How far an FP8 tensor-core GEMM's result may lie from the exact sum of its products:
    Hopper accumulates FP8 products keeping about 14 bits (DeepSeek-V3's report), so the error
    scales with the sum of the products' magnitudes, not with the result (which may cancel to
    near zero). 2^-8 of that sum, [M, N]: above that accumulation's error and a bf16 output's
    rounding, far below what a wrong index or scale gives."""
    x = a.float().abs() * expand_group_scales(a_scale, a.shape[1])
    return (x @ dequantize_blocks(w, w_scale).abs().T) * 2.0**-8


def native_block_scales(scale: torch.Tensor, in_features: int) -> torch.Tensor | None:
    """A layer's block scales [N / 128, G] for torch's blockwise GEMM, from its per-row scales
    [N, G]: None where that GEMM cannot take the layer (an input width not a multiple of 512,
    or blocks that do not all start on a 128th row, as in a fused matrix whose parts do not fill
    whole blocks), which then keeps the Triton GEMM."""
    if in_features % (NATIVE_K_BLOCKS * GROUP):
        return None
    return whole_block_scales(scale)


def block_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    w_row_scales: torch.Tensor,
    w_blocks: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x [M, K] (the model's dtype, on a GPU) quantized per token and 128 columns, times w [N, K]
    e4m3 under its block scales: through torch's blockwise GEMM where `w_blocks` is given and it
    runs here, else through the Triton GEMM with the per-row scales. -> [M, N] in out_dtype."""
    if w_blocks is not None and native_block_scaled_mm_works(x.device):
        a, a_scale = quantize_groups(x, NATIVE_ROWS, group_major=True)
        return block_scaled_mm_native(a, a_scale, w, w_blocks, out_dtype)[: x.shape[0]]
    a, a_scale = quantize_groups(x)
    return block_scaled_mm(a, a_scale, w, w_row_scales, out_dtype)
