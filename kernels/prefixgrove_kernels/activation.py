"""The gated MLPs' activation, act(gate) * up from the fused gate_up projection, one pass over
memory: SwiGLU's silu (`silu_and_mul`) and GeGLU's gelu with the tanh approximation (Gemma's
`gelu_pytorch_tanh`: `gelu_tanh_and_mul`), the same kernels with the activation a constexpr.

Rounds like torch does in the input dtype: the activation is computed in fp32 and rounded once,
then the product is computed in fp32 and rounded again.

`silu_and_mul_fp8` (and `gelu_tanh_and_mul_fp8`) writes the result as an FP8 linear layer takes it: e4m3 values and one float32
scale per row, the very bytes `fp8_quant.quantize_rows` would write from `silu_and_mul`'s output.
A row is too wide for one block, so its program computes it twice, once for the row's amax and once
to write it quantized; the result in x's dtype is never stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from prefixgrove_kernels import checks
from prefixgrove_kernels.fp8_quant import per_row_launch, quantize_rows_ref, row_scale
from prefixgrove_kernels.launch import KernelLaunch
from prefixgrove_kernels.rotary import to_e4m3

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_D = 1024
FP8_BLOCK_D = 2048  # columns of a row per step of the FP8 kernel's two loops


@triton.jit
def _activation(gate, GELU: tl.constexpr):
    """silu(gate), or with GELU gelu(gate) in torch's tanh approximation; gate in fp32.
    0.5 * (1 + tanh(u)) is taken as 1 / (1 + exp(-2u)), the same function without the
    cancellation of 1 + tanh(u) in the negative tail."""
    if GELU:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = tl.div_rn(gate, 1.0 + tl.exp(-2.0 * inner))
    else:
        # NOTE: IEEE division (not Triton's approximate `/`), as torch's silu divides.
        act = tl.div_rn(gate, 1.0 + tl.exp(-gate))
    return act


@triton.jit
def _act_mul(x_row_ptr, cols, mask, d, GELU: tl.constexpr):
    """act(gate) * up at `cols` of one row of x (x_row_ptr: its first element), in x's dtype."""
    gate = tl.load(x_row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row_ptr + d + cols, mask=mask, other=0.0)
    act = _activation(gate, GELU).to(x_row_ptr.dtype.element_ty)
    return (act.to(tl.float32) * up.to(tl.float32)).to(x_row_ptr.dtype.element_ty)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # x: [rows, 2 * d] = [gate | up]
    out_ptr,  # out: [rows, d]
    d,
    x_stride,
    out_stride,
    BLOCK_D: tl.constexpr,
    GELU: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < d
    out = _act_mul(x_ptr + row * x_stride, cols, mask, d, GELU)
    tl.store(out_ptr + row * out_stride + cols, out, mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr,  # x: [rows, 2 * d] = [gate | up]
    q_ptr,  # q: [rows, d] e4m3
    scale_ptr,  # scale: [rows] fp32
    d,
    x_stride,
    q_stride,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GELU: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    x_row_ptr = x_ptr + row * x_stride
    amax = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, d, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        out = _act_mul(x_row_ptr, cols, cols < d, d, GELU)
        amax = tl.maximum(amax, tl.abs(out.to(tl.float32)))
    scale = row_scale(tl.max(amax, axis=0), FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for start in range(0, d, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        inside = cols < d
        out = _act_mul(x_row_ptr, cols, inside, d, GELU)
        tl.store(q_ptr + row * q_stride + cols, to_e4m3(out.to(tl.float32), scale), mask=inside)


def _check_input(x: torch.Tensor) -> None:
    checks.check_tensor("x", x, ndim=2, dtypes=ACTIVATION_DTYPES, device=x.device, contiguous=False)
    checks.check_unit_last_stride("x", x)
    if x.shape[1] % 2 != 0:
        raise ValueError(f"x must be [rows, 2 * d] = [gate | up], got odd width {x.shape[1]}")


def silu_and_mul_launch(
    x: torch.Tensor, out: torch.Tensor | None = None, gelu: bool = False
) -> tuple[KernelLaunch | None, torch.Tensor]:
    """Checks the arguments and plans the launch `silu_and_mul` makes (with gelu,
    `gelu_tanh_and_mul`'s)."""
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
    options = {"BLOCK_D": block, "num_warps": 4} | ({"GELU": True} if gelu else {})
    return KernelLaunch(
        _silu_and_mul_kernel, grid, (x, out, d, x.stride(0), out.stride(0)), options
    ), out


def _gate_and_up(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's two halves, checked as the kernels check it: the references' input."""
    _check_input(x)
    gate, up = x.split(x.shape[1] // 2, dim=-1)
    return gate, up


def _run_act_and_mul(x: torch.Tensor, out: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    launch, out = silu_and_mul_launch(x, out, gelu)
    if launch is not None:
        launch.run()
    return out


def _run_act_and_mul_fp8(x: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    launch, q, scale = silu_and_mul_fp8_launch(x, gelu)
    if launch is not None:
        launch.run()
    return q, scale


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for x: [rows, 2 * d] = [gate | up] (rows may be strided); out: [rows, d]."""
    return _run_act_and_mul(x, out, gelu=False)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch version of `silu_and_mul` (the engine's unfused MLP gate)."""
    gate, up = _gate_and_up(x)
    return F.silu(gate) * up


def silu_and_mul_fp8_launch(
    x: torch.Tensor, gelu: bool = False
) -> tuple[KernelLaunch | None, torch.Tensor, torch.Tensor]:
    """Checks the argument and plans the launch `silu_and_mul_fp8` makes (with gelu,
    `gelu_tanh_and_mul_fp8`'s)."""
    _check_input(x)
    launch, q, scale = per_row_launch(
        _silu_and_mul_fp8_kernel, x, x.shape[1] // 2, "BLOCK_D", FP8_BLOCK_D
    )
    if launch is not None and gelu:
        launch = launch._replace(options=launch.options | {"GELU": True})
    return launch, q, scale


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_and_mul`'s output as an FP8 linear layer takes it: (e4m3 values [rows, d], float32
    scales [rows, 1]), the bytes `quantize_rows(silu_and_mul(x))` writes; x: [rows, 2 * d]."""
    return _run_act_and_mul_fp8(x, gelu=False)


def silu_and_mul_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `silu_and_mul_fp8`: `silu_and_mul_ref`'s output by `quantize_rows_ref`."""
    return quantize_rows_ref(silu_and_mul_ref(x))


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu_tanh(gate) * up (GeGLU), as `silu_and_mul` takes x and out."""
    return _run_act_and_mul(x, out, gelu=True)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch version of `gelu_tanh_and_mul` (transformers' gelu_pytorch_tanh gate)."""
    gate, up = _gate_and_up(x)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`gelu_tanh_and_mul`'s output as an FP8 linear layer takes it, as `silu_and_mul_fp8`."""
    return _run_act_and_mul_fp8(x, gelu=True)


def gelu_tanh_and_mul_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `gelu_tanh_and_mul_fp8`."""
    return quantize_rows_ref(gelu_tanh_and_mul_ref(x))
