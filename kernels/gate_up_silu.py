"""SwiGLU's gate/up projection with silu(gate) * up in its epilogue: out = silu(x @ W_gate^T) * (x @ W_up^T).

The unfused MLP writes the [rows, 2 * d] gate/up product to memory and a second kernel reads it back
to write [rows, d]: on a 16,384-token prefill chunk of an 8B model that is ~2.9 GB a layer, about a
twentieth of the step. Here each program keeps a gate tile and the matching up tile in registers
(two accumulators over the same x tile) and stores only their product.

Rounds like the unfused path: gate and up are rounded to the input dtype as the matmul's output
would be, silu is computed in fp32 and rounded, then the product is computed in fp32 and rounded.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from prefixgrove.kernels import checks
from prefixgrove.kernels.activation import silu_and_mul_ref
from prefixgrove.kernels.launch import KernelLaunch
from prefixgrove.kernels.paged_attention import dot_precision

GATE_UP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class TileConfig(NamedTuple):
    block_m: int
    block_n: int  # output columns of a program (gate and up tiles are each this wide)
    block_k: int
    group_m: int  # row tiles that walk the column tiles together (L2 reuse of the weight tiles)
    num_warps: int
    num_stages: int
    persistent: bool = False  # one program per SM walking the tiles, keys and weights through TMA
    warp_specialize: bool = False  # (persistent only) producer and consumer warps


# Chosen on an H100 by benchmarks/gate_up_silu.py (Llama-3.1-8B shapes, bf16).
LARGE_M = TileConfig(128, 128, 64, 8, 8, 3)
SMALL_M = TileConfig(64, 128, 64, 8, 4, 4)
SMALL_M_ROWS = 1024


@triton.jit
def _gate_up_silu_kernel(
    x_ptr,  # x: [rows, k] (unit last stride)
    w_ptr,  # w: [2 * d, k] = [gate rows; up rows] (nn.Linear's layout, unit last stride)
    out_ptr,  # out: [rows, d] (unit last stride)
    rows,
    d,
    k,
    x_stride,
    w_stride,
    out_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(d, BLOCK_N)
    # Grouped order: GROUP_M row tiles sweep the column tiles together, so each weight tile is read
    # from HBM about once per GROUP_M row tiles instead of once per row tile.
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    # Rows and columns past the end wrap around (their results are never stored), so the main loop
    # loads without masks.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % rows
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % d
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * x_stride + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    # [BLOCK_K, BLOCK_N] views of the gate rows and the up rows d rows further on
    gate_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * w_stride + offs_k[:, None]
    up_ptrs = gate_ptrs + d.to(tl.int64) * w_stride

    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(k, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b_gate = tl.load(gate_ptrs)
            b_up = tl.load(up_ptrs)
        else:
            k_left = k - kk * BLOCK_K
            a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b_gate = tl.load(gate_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            b_up = tl.load(up_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc_gate = tl.dot(a, b_gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K

    dtype = out_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    # NOTE: IEEE division (not Triton's approximate `/`), as torch's silu divides.
    silu = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
    out = (silu * up).to(dtype)

    rows_out = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + rows_out.to(tl.int64)[:, None] * out_stride + cols_out[None, :]
    tl.store(out_ptrs, out, mask=(rows_out[:, None] < rows) & (cols_out[None, :] < d))


@triton.jit
def _gate_up_silu_tma_kernel(
    x_desc,  # TMA descriptor of x: [rows, k], blocks [BLOCK_M, BLOCK_K]
    w_desc,  # TMA descriptor of w: [2 * d, k], blocks [BLOCK_N, BLOCK_K]
    out_ptr,  # out: [rows, d] (unit last stride)
    rows,
    d,
    k,
    out_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(d, BLOCK_N)
    per_group = GROUP_M * tiles_n
    k_tiles = tl.cdiv(k, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    for tile in tl.range(
        tl.program_id(0),
        tiles_m * tiles_n,
        NUM_PROGRAMS,
        flatten=True,
        warp_specialize=WARP_SPECIALIZE,
    ):
        first_m = (tile // per_group) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_rows
        pid_n = (tile % per_group) // group_rows
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            a = x_desc.load([off_m, kk * BLOCK_K])
            b_gate = w_desc.load([off_n, kk * BLOCK_K])
            b_up = w_desc.load([d + off_n, kk * BLOCK_K])
            acc_gate = tl.dot(a, b_gate.T, acc_gate)
            acc_up = tl.dot(a, b_up.T, acc_up)
        gate = acc_gate.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        silu = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
        out = (silu * up).to(dtype)
        rows_out = off_m + tl.arange(0, BLOCK_M)
        cols_out = off_n + tl.arange(0, BLOCK_N)
        out_ptrs = out_ptr + rows_out.to(tl.int64)[:, None] * out_stride + cols_out[None, :]
        tl.store(out_ptrs, out, mask=(rows_out[:, None] < rows) & (cols_out[None, :] < d))


def _check_inputs(x: torch.Tensor, w: torch.Tensor) -> None:
    checks.check_tensor("x", x, ndim=2, dtypes=GATE_UP_DTYPES, device=x.device, contiguous=False)
    checks.check_unit_last_stride("x", x)
    checks.check_tensor("w", w, ndim=2, dtypes=(x.dtype,), device=x.device, contiguous=False)
    checks.check_unit_last_stride("w", w)
    if w.shape[1] != x.shape[1]:
        raise ValueError(
            f"w must be [2 * d, {x.shape[1]}] to multiply x of shape {tuple(x.shape)}, "
            f"got {tuple(w.shape)}"
        )
    if w.shape[0] % 2 != 0:
        raise ValueError(f"w must be [2 * d, k] = [gate; up], got odd row count {w.shape[0]}")


def default_tile_config(rows: int) -> TileConfig:
    return SMALL_M if rows <= SMALL_M_ROWS else LARGE_M


def gate_up_silu_launch(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    config: TileConfig | None = None,
) -> tuple[KernelLaunch | None, torch.Tensor]:
    """Checks the arguments and plans the launch `gate_up_silu` makes."""
    _check_inputs(x, w)
    rows, k = x.shape
    d = w.shape[0] // 2
    out = x.new_empty((rows, d)) if out is None else out
    checks.check_tensor("out", out, ndim=2, dtypes=(x.dtype,), device=x.device, contiguous=False)
    checks.check_unit_last_stride("out", out)
    checks.check_shape("out", out, (rows, d))
    if rows == 0 or d == 0:
        return None, out
    c = config or default_tile_config(rows)
    if c.persistent:
        return _tma_launch(x, w, out, c), out
    grid = (triton.cdiv(rows, c.block_m) * triton.cdiv(d, c.block_n),)
    options = {
        "BLOCK_M": c.block_m,
        "BLOCK_N": c.block_n,
        "BLOCK_K": c.block_k,
        "GROUP_M": c.group_m,
        "EVEN_K": k % c.block_k == 0,
        "DOT_PRECISION": dot_precision(x.dtype),
        "num_warps": c.num_warps,
        "num_stages": c.num_stages,
    }
    args = (x, w, out, rows, d, k, x.stride(0), w.stride(0), out.stride(0))
    return KernelLaunch(_gate_up_silu_kernel, grid, args, options), out


def _tma_launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, c: TileConfig) -> KernelLaunch:
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, k = x.shape
    d = w.shape[0] // 2
    tiles = triton.cdiv(rows, c.block_m) * triton.cdiv(d, c.block_n)
    programs = min(tiles, torch.cuda.get_device_properties(x.device).multi_processor_count)
    x_desc = TensorDescriptor.from_tensor(x, [c.block_m, c.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [c.block_n, c.block_k])
    options = {
        "BLOCK_M": c.block_m,
        "BLOCK_N": c.block_n,
        "BLOCK_K": c.block_k,
        "GROUP_M": c.group_m,
        "NUM_PROGRAMS": programs,
        "WARP_SPECIALIZE": c.warp_specialize,
        "num_warps": c.num_warps,
        "num_stages": c.num_stages,
    }
    args = (x_desc, w_desc, out, rows, d, k, out.stride(0))
    return KernelLaunch(_gate_up_silu_tma_kernel, (programs,), args, options)


def gate_up_silu(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """silu(x @ w[:d].T) * (x @ w[d:].T) for x: [rows, k], w: [2 * d, k]; out: [rows, d]."""
    launch, out = gate_up_silu_launch(x, w, out, config)
    if launch is not None:
        launch.run()
    return out


def gate_up_silu_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Torch version of `gate_up_silu`: the unfused projection, then silu(gate) * up."""
    _check_inputs(x, w)
    return silu_and_mul_ref(torch.nn.functional.linear(x, w))
