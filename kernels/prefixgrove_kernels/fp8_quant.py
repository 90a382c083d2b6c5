"""Per-token FP8 quantization of a linear layer's input, one pass of reads per row (W8A8's dynamic
activation scales): scale = max(amax(|row|) / 448, 1e-12), values = clamp(row / scale, +-448) in e4m3.

In torch the same takes a float32 copy, |x|, the row max, a division, a clamp and the cast: six passes
over the activations of every FP8 layer, which cost more than the FP8 matmul saves on the prefill's large
inputs. The division is IEEE (as torch's) and the rounding to nearest even is done in fp32 arithmetic
(rotary.to_e4m3, the FP8 KV cache's), so the kernel writes the bytes the torch version writes on every
target, Triton's interpreter included.

The RMSNorm and SiLU-and-mul kernels quantize their own outputs by the same rule (`row_scale`,
`rotary.to_e4m3`) where the linear after them takes FP8 rows, so that no pass reads those
activations again; this kernel quantizes the rest (o_proj's input).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgrove_kernels import checks
from prefixgrove_kernels.checks import FP8_KV_DTYPE, FP8_MAX, MIN_SCALE
from prefixgrove_kernels.launch import KernelLaunch
from prefixgrove_kernels.reference_math import quantize_rows_math
from prefixgrove_kernels.rotary import to_e4m3

INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_C = 2048
# The constexprs of every kernel that calls `row_scale`.
ROW_SCALE_OPTIONS = {"FP8_MAX": FP8_MAX, "MIN_SCALE": MIN_SCALE}


@triton.jit
def row_scale(amax, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """A row's scale from its amax (fp32), by IEEE division as torch's (Triton's `/` is
    approximate on the GPU): every kernel that quantizes rows takes it from here, so all write the
    same bytes."""
    return tl.maximum(tl.div_rn(amax, FP8_MAX), MIN_SCALE)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [rows, C] input (row stride free)
    q_ptr,  # [rows, C] e4m3 out
    scale_ptr,  # [rows] fp32 out
    C,
    x_stride,
    q_stride,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK_C], dtype=tl.float32)
    for start in range(0, C, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        x = tl.load(x_ptr + row * x_stride + cols, mask=cols < C, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = row_scale(tl.max(amax, axis=0), FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for start in range(0, C, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        inside = cols < C
        x = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * q_stride + cols, to_e4m3(x, scale), mask=inside)


def _check(x: torch.Tensor) -> None:
    checks.check_tensor("x", x, ndim=2, dtypes=INPUT_DTYPES, device=x.device, contiguous=False)
    checks.check_unit_last_stride("x", x)


def per_row_launch(
    kernel: triton.JITFunction, x: torch.Tensor, cols: int, block_name: str, max_block: int
) -> tuple[KernelLaunch | None, torch.Tensor, torch.Tensor]:
    """The launch of a kernel writing, one program per row of x, `cols` e4m3 values and the row's
    scale (its arguments: x, values, scales, cols, x's and the values' row strides, then
    ROW_SCALE_OPTIONS and a column block named `block_name`), with the outputs it fills."""
    rows = x.shape[0]
    q = torch.empty((rows, cols), dtype=FP8_KV_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0 or cols == 0:
        return None, q, scale
    block = min(max_block, triton.next_power_of_2(cols))
    args = (x, q, scale, cols, x.stride(0), q.stride(0))
    options = {**ROW_SCALE_OPTIONS, block_name: block, "num_warps": 8}
    return KernelLaunch(kernel, (rows,), args, options), q, scale


def quantize_rows_launch(
    x: torch.Tensor,
) -> tuple[KernelLaunch | None, torch.Tensor, torch.Tensor]:
    """Checks the argument and plans the launch `quantize_rows` makes."""
    _check(x)
    return per_row_launch(_quantize_rows_kernel, x, x.shape[1], "BLOCK_C", BLOCK_C)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, C] -> (e4m3 values [rows, C], float32 scales [rows, 1]), x ~= values * scales."""
    launch, q, scale = quantize_rows_launch(x)
    if launch is not None:
        launch.run()
    return q, scale


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `quantize_rows` (the engine's path on the CPU)."""
    _check(x)
    return quantize_rows_math(x)
