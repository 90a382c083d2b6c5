"""SwiGLU's gate: silu(gate) * up from the fused gate_up projection, one pass over memory.

Rounds like torch does in the input dtype: silu is computed in fp32 and rounded once, then the
product is computed in fp32 and rounded again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from prefixgrove_kernels import checks
from prefixgrove_kernels.launch import KernelLaunch

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_D = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # x: [rows, 2 * d] = [gate | up]
    out_ptr,  # out: [rows, d]
    d,
    x_stride,
    out_stride,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0)
    # NOTE: IEEE division (not Triton's approximate `/`), as torch's silu divides.
    silu = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(x_ptr.dtype.element_ty)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_input(x: torch.Tensor) -> None:
    checks.check_tensor("x", x, ndim=2, dtypes=ACTIVATION_DTYPES, device=x.device, contiguous=False)
    checks.check_unit_last_stride("x", x)
    if x.shape[1] % 2 != 0:
        raise ValueError(f"x must be [rows, 2 * d] = [gate | up], got odd width {x.shape[1]}")


def silu_and_mul_launch(
    x: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[KernelLaunch | None, torch.Tensor]:
    """Checks the arguments and plans the launch `silu_and_mul` makes."""
    _check_input(x)
    rows, d = x.shape[0], x.shape[1] // 2
    out = x.new_empty((rows, d)) if out is None else out
    checks.check_tensor("out", out, ndim=2, dtypes=(x.dtype,), device=x.device, contiguous=False)
    checks.check_unit_last_stride("out", out)
    checks.check_shape("out", out, (rows, d))
    if rows == 0 or d == 0:
        return None, out
    block = min(BLOCK_D, triton.next_power_of_2(d))
    grid = (rows, triton.cdiv(d, block))
    options = {"BLOCK_D": block, "num_warps": 4}
    return KernelLaunch(
        _silu_and_mul_kernel, grid, (x, out, d, x.stride(0), out.stride(0)), options
    ), out


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for x: [rows, 2 * d] = [gate | up] (rows may be strided); out: [rows, d]."""
    launch, out = silu_and_mul_launch(x, out)
    if launch is not None:
        launch.run()
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch version of `silu_and_mul` (the engine's unfused MLP gate)."""
    _check_input(x)
    gate, up = x.split(x.shape[1] // 2, dim=-1)
    return F.silu(gate) * up
