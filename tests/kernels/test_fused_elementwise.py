"""rms_norm and silu_and_mul (Triton) against their torch references, fp32 and fp16 (rotary:
test_fused_rotary.py).

Rotary rounds exactly like the reference. silu_and_mul's exp is numpy's here and torch's own in the
reference, each about one unit in the last place (ulp) off: fp32 results stay within 4 ulps (exp,
divide and multiply errors added up), fp16 within 1. rms_norm reduces the sum of squares in
another order and takes rsqrt another way: the row scale differs by an ulp or two in fp32, which
the two roundings after it grow to at most 4 ulps of the output; in fp16 one ulp before the weight
multiply, at most 2 after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from elementwise_checks import (
    DTYPES,
    EPS,
    NORM_ULPS,
    SILU_ULPS,
    assert_mostly_equal,
    assert_ulps,
    randn,
)

from prefixgrove_kernels.activation import silu_and_mul, silu_and_mul_ref
from prefixgrove_kernels.rmsnorm import rms_norm, rms_norm_ref

# ---- rms_norm -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (7, 100), (33, 128), (5, 1000), (3, 4096)])
def test_rms_norm_matches_reference(
    dtype: torch.dtype, device: torch.device, rows: int, hidden: int
) -> None:
    x = randn(rows, hidden, dtype=dtype, device=device) * 3
    weight = randn(hidden, dtype=dtype, device=device, seed=1)
    got, want = rms_norm(x, weight, EPS), rms_norm_ref(x, weight, EPS)
    assert_ulps(got, want, NORM_ULPS[dtype])


def test_rms_norm_rounds_to_the_input_dtype_before_the_weight_multiply(
    device: torch.device,
) -> None:
    x = randn(5, 1000, dtype=torch.float16, device=device) * 3
    weight = randn(1000, dtype=torch.float16, device=device, seed=1)
    assert_mostly_equal(rms_norm(x, weight, EPS), rms_norm_ref(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_strided_rows_and_writes_given_out(
    dtype: torch.dtype, device: torch.device
) -> None:
    wide = randn(9, 700, dtype=dtype, device=device)
    x = wide[:, 100:612]  # row stride 700
    weight = randn(512, dtype=dtype, device=device, seed=1)
    buffer = torch.full((9, 1024), float("nan"), dtype=dtype, device=device)
    out = buffer[:, :512]
    got = rms_norm(x, weight, EPS, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_ulps(got, rms_norm_ref(x, weight, EPS), NORM_ULPS[dtype])
    assert buffer[:, 512:].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 300, 4096])
def test_rms_norm_with_residual_returns_normed_sum_and_sum(
    dtype: torch.dtype, device: torch.device, hidden: int
) -> None:
    x = randn(11, hidden, dtype=dtype, device=device)
    residual = randn(11, 2 * hidden, dtype=dtype, device=device, seed=2)[:, :hidden]
    weight = randn(hidden, dtype=dtype, device=device, seed=1)
    out, new_residual = rms_norm(x, weight, EPS, residual=residual)
    want_out, want_residual = rms_norm_ref(x, weight, EPS, residual=residual)
    assert torch.equal(new_residual, want_residual)
    assert_ulps(out, want_out, NORM_ULPS[dtype])
    if dtype == torch.float16:  # normalises the rounded sum, not the exact one
        assert_mostly_equal(out, want_out)


def test_rms_norm_updates_residual_and_x_in_place(device: torch.device) -> None:
    x = randn(5, 256, dtype=torch.float16, device=device)
    residual = randn(5, 256, dtype=torch.float16, device=device, seed=2)
    weight = randn(256, dtype=torch.float16, device=device, seed=1)
    want_out, want_residual = rms_norm_ref(x, weight, EPS, residual=residual)
    rms_norm(x, weight, EPS, residual=residual, out=x, residual_out=residual)
    assert torch.equal(residual, want_residual)
    assert_ulps(x, want_out, NORM_ULPS[torch.float16])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(1, 1, 64), (8, 2, 128), (32, 8, 128)])
def test_rms_norm_per_head_on_views_of_a_fused_qkv(
    dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, head_dim: int
) -> None:
    tokens, q_size, kv_size = 7, heads * head_dim, kv_heads * head_dim
    qkv = randn(tokens, q_size + 2 * kv_size, dtype=dtype, device=device)
    q = qkv[:, :q_size].view(tokens, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    weight = randn(head_dim, dtype=dtype, device=device, seed=1)
    for view in (q, k):
        want = rms_norm_ref(view.reshape(-1, head_dim), weight, EPS).view(view.shape)
        assert_ulps(rms_norm(view, weight, EPS), want, NORM_ULPS[dtype])
        assert_ulps(
            rms_norm(view.reshape(-1, head_dim), weight, EPS).view(view.shape),
            want,
            NORM_ULPS[dtype],
        )


def test_rms_norm_handles_the_largest_hidden_size(device: torch.device) -> None:
    x = randn(2, 16384, dtype=torch.float32, device=device)
    weight = randn(16384, dtype=torch.float32, device=device, seed=1)
    assert_ulps(rms_norm(x, weight, EPS), rms_norm_ref(x, weight, EPS), NORM_ULPS[torch.float32])


def test_rms_norm_of_no_rows_is_empty(device: torch.device) -> None:
    x = torch.empty(0, 128, device=device)
    assert rms_norm(x, torch.ones(128, device=device), EPS).shape == (0, 128)


def test_rms_norm_rejects_bad_arguments_with_the_offending_value(device: torch.device) -> None:
    x = torch.ones(4, 64, device=device)
    with pytest.raises(TypeError, match=r"weight has dtype torch\.float16"):
        rms_norm(x, torch.ones(64, dtype=torch.float16, device=device), EPS)
    with pytest.raises(ValueError, match=r"weight must have shape \(64,\), got \(32,\)"):
        rms_norm(x, torch.ones(32, device=device), EPS)
    with pytest.raises(ValueError, match="x must have unit stride"):
        rms_norm(x.t(), torch.ones(4, device=device), EPS)
    with pytest.raises(ValueError, match="hidden size 32768"):
        rms_norm(torch.ones(1, 32768, device=device), torch.ones(32768, device=device), EPS)
    with pytest.raises(ValueError, match="eps must be a positive number"):
        rms_norm(x, torch.ones(64, device=device), 0.0)
    with pytest.raises(ValueError, match="residual_out was given without a residual"):
        rms_norm(x, torch.ones(64, device=device), EPS, residual_out=x)


# ---- silu_and_mul ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "d"), [(1, 64), (7, 100), (3, 1024), (5, 2500)])
def test_silu_and_mul_matches_torch(
    dtype: torch.dtype, device: torch.device, rows: int, d: int
) -> None:
    x = randn(rows, 2 * d, dtype=dtype, device=device) * 4
    assert_ulps(silu_and_mul(x), silu_and_mul_ref(x), SILU_ULPS[dtype])


def test_silu_and_mul_rounds_silu_before_the_multiply_like_torch(device: torch.device) -> None:
    x = randn(5, 2 * 2500, dtype=torch.float16, device=device) * 4
    assert_mostly_equal(silu_and_mul(x), silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_reads_strided_rows_and_writes_strided_out(
    dtype: torch.dtype, device: torch.device
) -> None:
    x = randn(9, 3000, dtype=dtype, device=device)[:, 200:2248]  # row stride 3000
    out = torch.full((9, 1500), float("nan"), dtype=dtype, device=device)[:, 100:1124]
    got = silu_and_mul(x, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_ulps(out, silu_and_mul_ref(x), SILU_ULPS[dtype])


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy's exp(1e4)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_saturates_like_torch_at_extreme_gates(
    dtype: torch.dtype, device: torch.device
) -> None:
    gate = torch.tensor([-1e4, -100.0, -20.0, -0.0, 0.0, 1e-3, 20.0, 100.0, 6e4], dtype=dtype)
    x = torch.cat([gate, torch.full_like(gate, 3.0)]).view(1, -1).to(device)
    got, want = silu_and_mul(x), silu_and_mul_ref(x)
    assert torch.equal(got.isinf(), want.isinf())
    assert_ulps(got[want.isfinite()], want[want.isfinite()], SILU_ULPS[dtype])


def test_silu_and_mul_rejects_bad_arguments_with_the_offending_value(device: torch.device) -> None:
    with pytest.raises(ValueError, match="odd width 7"):
        silu_and_mul(torch.ones(2, 7, device=device))
    with pytest.raises(ValueError, match=r"out must have shape \(2, 4\)"):
        silu_and_mul(torch.ones(2, 8, device=device), out=torch.empty(2, 8, device=device))
    with pytest.raises(TypeError, match=r"x has dtype torch\.int64"):
        silu_and_mul(torch.ones(2, 8, dtype=torch.int64, device=device))


# ---- the benchmark --------------------------------------------------------------------------


def test_benchmark_reports_every_operation_and_the_paths_agree() -> None:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "elementwise_kernels.py"
    args = "--device cpu --dtype float16 --tokens 3 --hidden 128 --heads 2 --kv-heads 1"
    args += " --head-dim 32 --intermediate 128 --max-positions 16"
    done = subprocess.run(
        [sys.executable, str(script), *args.split()],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)["results"]
    ops = ["rms_norm", "add_rms_norm", "qk_head_norm", "rotary", "rotary_to_cache", "silu_and_mul"]
    assert [r["op"] for r in results] == ops
    # Outputs stay below 16 here, where 2 fp16 ulps are 2 ** -6.
    assert all(r["max_abs_diff"] <= 2**-6 and r["fused_us"] > 0 for r in results)
