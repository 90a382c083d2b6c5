"""RMS normalisation, optionally fused with the residual add that precedes it, one pass over memory.

Matches Hugging Face Llama's cast order: normalise in fp32, cast back to the input dtype, then
multiply by the weight in the input dtype. Rows are the leading dimensions of x (one or two of
them, so the per-head q/k norm of Qwen3 runs on a [tokens, heads, head_dim] view of a fused qkv
output without a copy).

`rms_norm_fp8` writes the output as an FP8 linear layer takes it: e4m3 values and one float32 scale
per row, the very bytes `fp8_quant.quantize_rows` would write from `rms_norm`'s output, in the same
pass (a row is whole in one program, so its amax is at hand).
"""

from __future__ import annotations

from typing import Any, overload

import torch
import triton
import triton.language as tl

from prefixgrove_kernels import checks
from prefixgrove_kernels.calls import takes_arguments_of
from prefixgrove_kernels.checks import FP8_KV_DTYPE
from prefixgrove_kernels.fp8_quant import ROW_SCALE_OPTIONS, quantize_rows_ref, row_scale
from prefixgrove_kernels.launch import KernelLaunch
from prefixgrove_kernels.rotary import to_e4m3

NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HIDDEN = 16384
# Elements a program holds at once; small rows (head_dim) are packed several to a program.
ELEMENTS_PER_PROGRAM = 4096


@triton.jit(do_not_specialize=["num_rows"])  # a per-step count: no recompiles
def _rms_norm_kernel(
    x_ptr,  # x: [outer, inner, hidden] (a 2-D x is [rows, 1, hidden])
    res_ptr,  # residual: like x, or unused when HAS_RESIDUAL is false
    res_out_ptr,  # new residual x + residual: like x
    w_ptr,  # weight: [hidden]
    out_ptr,  # out: like x; with QUANTIZE [rows, hidden] e4m3
    scale_ptr,  # with QUANTIZE: [rows] fp32, out's scale per row; else unused
    num_rows,
    inner,
    hidden,
    x_stride_o,
    x_stride_i,
    res_stride_o,
    res_stride_i,
    res_out_stride_o,
    res_out_stride_i,
    out_stride_o,
    out_stride_i,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANTIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    X_VECTOR: tl.constexpr,  # elements of x in 16 bytes, the widest load or store of a thread
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    outer_idx = (rows // inner).to(tl.int64)
    inner_idx = (rows % inner).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    x_offs = (outer_idx * x_stride_o + inner_idx * x_stride_i)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_offs = (outer_idx * res_stride_o + inner_idx * res_stride_i)[:, None] + cols[None, :]
        r = tl.load(res_ptr + r_offs, mask=mask, other=0.0)
        # The add rounds to the input dtype, as the unfused `x = x + attn_out` does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        s_offs = (outer_idx * res_out_stride_o + inner_idx * res_out_stride_i)[:, None]
        tl.store(res_out_ptr + s_offs + cols[None, :], x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=1) / hidden
    normed = (x32 * tl.rsqrt(mean_sq + eps)[:, None]).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0)
    out = (w[None, :].to(tl.float32) * normed.to(tl.float32)).to(x_ptr.dtype.element_ty)
    o_offs = (outer_idx * out_stride_o + inner_idx * out_stride_i)[:, None] + cols[None, :]
    if QUANTIZE:
        # The rounded output above, quantized as quantize_rows quantizes what rms_norm stores.
        out32 = out.to(tl.float32)
        scale = row_scale(tl.max(tl.abs(out32), axis=1), FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + rows, scale, mask=rows < num_rows)
        out = to_e4m3(out32, scale[:, None])
        # NOTE: a thread stores no more e4m3 values at once than it loads of x: the compiler sizes
        # its tiles for the widest access, and the tiles set the order in which the sum of squares
        # adds up. Capped so, they are the unfused kernel's, and so is the sum, bit for bit.
        o_offs = tl.max_contiguous(o_offs, [1, X_VECTOR])
    tl.store(out_ptr + o_offs, out, mask=mask)


def _check_like_x(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    checks.check_tensor(name, t, ndim=x.dim(), dtypes=(x.dtype,), device=x.device, contiguous=False)
    checks.check_unit_last_stride(name, t)
    checks.check_shape(name, t, tuple(x.shape))


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be [rows, hidden] or [tokens, heads, head_dim], got {shape}")
    checks.check_tensor("x", x, ndim=x.dim(), dtypes=NORM_DTYPES, device=x.device, contiguous=False)
    checks.check_unit_last_stride("x", x)
    hidden = x.shape[-1]
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is not supported; use 1..{MAX_HIDDEN}")
    checks.check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,), device=x.device)
    checks.check_shape("weight", weight, (hidden,))
    if not isinstance(eps, float | int) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")


def _check_rows(x: torch.Tensor) -> None:
    if isinstance(x, torch.Tensor) and x.dim() != 2:
        raise ValueError(f"rms_norm_fp8 takes x as [rows, hidden], got {tuple(x.shape)}")


def _residual_out(
    x: torch.Tensor, residual: torch.Tensor | None, residual_out: torch.Tensor | None
) -> torch.Tensor | None:
    """Checks the residual arguments; returns where x + residual goes (None without a residual)."""
    if residual is None:
        if residual_out is not None:
            raise ValueError("residual_out was given without a residual to add")
        return None
    _check_like_x("residual", residual, x)
    if residual_out is None:
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _check_like_x("residual_out", residual_out, x)
    return residual_out


def _strides(t: torch.Tensor) -> tuple[int, int]:
    """(outer, inner) row strides, a 2-D tensor being [rows, 1, hidden]."""
    return (t.stride(0), t.stride(1)) if t.dim() == 3 else (t.stride(0), 0)


def rms_norm_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[KernelLaunch | None, torch.Tensor, torch.Tensor | None]:
    """Checks the arguments and plans the launch `rms_norm` makes."""
    _check_inputs(x, weight, eps)
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    _check_like_x("out", out, x)
    residual_out = _residual_out(x, residual, residual_out)
    plan = _plan(x, weight, eps, residual=residual, residual_out=residual_out, out=out, scale=None)
    return plan, out, residual_out


def _plan(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    out: torch.Tensor,
    scale: torch.Tensor | None,
) -> KernelLaunch | None:
    """The launch over checked arguments; with `scale`, out is e4m3 and scale its row scales."""
    inner = x.shape[1] if x.dim() == 3 else 1
    num_rows = x.numel() // x.shape[-1]
    if num_rows == 0:
        return None
    block = triton.next_power_of_2(x.shape[-1])
    # NOTE: from the row width only, so a batch size never selects another compiled variant.
    block_rows = max(1, ELEMENTS_PER_PROGRAM // block)
    res = residual if residual is not None else x
    res_out = residual_out if residual_out is not None else out
    scale_arg = scale if scale is not None else out
    args: tuple[Any, ...] = (x, res, res_out, weight, out, scale_arg, num_rows, inner, x.shape[-1])
    args += (*_strides(x), *_strides(res), *_strides(res_out), *_strides(out), float(eps))
    options = {
        "HAS_RESIDUAL": residual is not None,
        "QUANTIZE": scale is not None,
        **ROW_SCALE_OPTIONS,
        "X_VECTOR": 16 // x.element_size(),
        "BLOCK_ROWS": block_rows,
        "BLOCK": block,
        "num_warps": min(16, max(1, block_rows * block // 512)),
        # NOTE: no fused multiply-adds: which product of the sum of squares the compiler would fuse
        # into an addition depends on the code around it, so the FP8 variant's sums (of fp32 x)
        # could differ from this kernel's in the last bit.
        "enable_fp_fusion": False,
    }
    grid = (triton.cdiv(num_rows, block_rows),)
    return KernelLaunch(_rms_norm_kernel, grid, args, options)


@overload
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: None = None,
    out: torch.Tensor | None = None,
    residual_out: None = None,
) -> torch.Tensor: ...


@overload
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(*args: Any, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * rms-normalised x, or with `residual`: (rms_norm(x + residual), x + residual);
    the arguments are those of the overloads above (and of `rms_norm_launch`).

    x: [rows, hidden] or [tokens, heads, head_dim], unit last stride, other strides free;
    weight: [hidden] in x's dtype. `out` and `residual_out` (either may alias its input for an
    in-place update) default to new contiguous tensors.
    """
    launch, out, residual_out = rms_norm_launch(*args, **kwargs)
    if launch is not None:
        launch.run()
    if residual_out is None:
        return out
    return out, residual_out


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `rms_norm` (Hugging Face Llama's RMSNorm, after the residual add)."""
    _check_inputs(x, weight, eps)
    s = x if residual is None else x + residual
    s32 = s.float()
    s32 = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * s32.to(s.dtype)
    return out if residual is None else (out, s)


def rms_norm_fp8_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[KernelLaunch | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Checks the arguments and plans the launch `rms_norm_fp8` makes."""
    _check_inputs(x, weight, eps)
    _check_rows(x)
    residual_out = _residual_out(x, residual, None)
    q = torch.empty(x.shape, dtype=FP8_KV_DTYPE, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    plan = _plan(x, weight, eps, residual=residual, residual_out=residual_out, out=q, scale=scale)
    return plan, q, scale, residual_out


@takes_arguments_of(rms_norm_fp8_launch)
def rms_norm_fp8(
    *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`rms_norm`'s output as an FP8 linear layer takes it: (e4m3 values [rows, hidden], float32
    scales [rows, 1], x + residual or None), the bytes `quantize_rows(rms_norm(...))` writes.

    x: [rows, hidden], unit last stride, row stride free; weight: [hidden] in x's dtype."""
    launch, q, scale, residual_out = rms_norm_fp8_launch(*args, **kwargs)
    if launch is not None:
        launch.run()
    return q, scale, residual_out


def rms_norm_fp8_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Torch version of `rms_norm_fp8`: `rms_norm_ref`'s output quantized by `quantize_rows_ref`."""
    _check_rows(x)
    normed = rms_norm_ref(x, weight, eps, residual)
    out, summed = normed if isinstance(normed, tuple) else (normed, None)
    q, scale = quantize_rows_ref(out)
    return q, scale, summed
