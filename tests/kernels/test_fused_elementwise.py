"""rms_norm, apply_rotary and silu_and_mul (Triton) against their torch references, fp32 and fp16.

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
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from prefixgrove.engine.models.rotary import rotary_table
from prefixgrove_kernels.activation import silu_and_mul, silu_and_mul_ref
from prefixgrove_kernels.rmsnorm import rms_norm, rms_norm_ref
from prefixgrove_kernels.rotary import (
    apply_rotary,
    apply_rotary_ref,
    apply_rotary_to_cache,
    apply_rotary_to_cache_ref,
)

DTYPES = [torch.float32, torch.float16]
MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
SMALLEST_SPACING = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}
EPS = 1e-6
NORM_ULPS = {torch.float32: 4, torch.float16: 2}
SILU_ULPS = {torch.float32: 4, torch.float16: 1}


def assert_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int) -> None:
    """Every element of got is within `ulps` units in the last place (of want's dtype) of want."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double().cpu(), want.double().cpu()
    assert torch.equal(g.isnan(), w.isnan())
    _, exponent = torch.frexp(w)
    spacing = torch.ldexp(torch.ones_like(w), exponent - 1 - MANTISSA_BITS[want.dtype])
    spacing = spacing.clamp(min=SMALLEST_SPACING[want.dtype])
    err = ((g - w).abs() / spacing).nan_to_num(0.0)
    assert err.max().item() <= ulps, f"{err.max().item()} ulps apart (allowed {ulps})"


def assert_mostly_equal(got: torch.Tensor, want: torch.Tensor, min_fraction: float = 0.99) -> None:
    """Nearly every element is bit-for-bit the reference's: an ulp tolerance alone would let a
    kernel skip one of the reference's roundings (a quarter of fp16 elements then differ)."""
    equal = (got == want).float().mean().item()
    assert equal >= min_fraction, f"only {equal:.2%} of elements equal the reference"


def randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


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


# ---- apply_rotary ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadShape:
    """An attention layer's query heads, kv heads and head_dim; printed as its test id."""

    heads: int
    kv_heads: int
    head_dim: int

    def __str__(self) -> str:
        return f"h{self.heads}-kv{self.kv_heads}-d{self.head_dim}"


def fused_qkv_views(
    tokens: int, shape: HeadShape, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v as the attention layer sees them: views of one fused qkv output."""
    heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.head_dim
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = randn(tokens, q_size + 2 * kv_size, dtype=dtype, device=device) * 4
    q = qkv[:, :q_size].view(tokens, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
    return q, k, v


def shuffled_positions(tokens: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randperm(4 * tokens, generator=gen)[:tokens].to(dtype=dtype, device=device)


def positions_and_table(
    tokens: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`shuffled_positions` and a Llama-3 rotary table (theta 500000) over all it may draw."""
    cos_sin = rotary_table(head_dim, 4 * tokens, 500000.0, None).to(device)
    return shuffled_positions(tokens, dtype, device), cos_sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    [HeadShape(1, 1, 32), HeadShape(4, 2, 64), HeadShape(12, 4, 128), HeadShape(32, 8, 128)],
    ids=str,
)
@pytest.mark.parametrize("position_dtype", [torch.int32, torch.int64])
def test_rotary_on_fused_qkv_views_matches_the_reference(
    dtype: torch.dtype, device: torch.device, shape: HeadShape, position_dtype: torch.dtype
) -> None:
    tokens = 13
    q, k, _ = fused_qkv_views(tokens, shape, dtype, device)
    positions, cos_sin = positions_and_table(tokens, shape.head_dim, position_dtype, device)
    got_q, got_k = apply_rotary(q, k, positions, cos_sin)
    want_q, want_k = apply_rotary_ref(q, k, positions, cos_sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_rotates_the_qkv_buffer(dtype: torch.dtype, device: torch.device) -> None:
    cos_sin = rotary_table(64, 64, 10000.0, {"rope_type": "linear", "factor": 2.0}).to(device)
    q, k, _ = fused_qkv_views(9, HeadShape(6, 3, 64), dtype, device)
    positions = shuffled_positions(9, torch.int64, device)
    want_q, want_k = apply_rotary_ref(q, k, positions, cos_sin)
    got_q, got_k = apply_rotary(q, k, positions, cos_sin, q_out=q, k_out=k)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_rotary_of_no_tokens_is_empty(device: torch.device) -> None:
    q, k = torch.empty(0, 4, 64, device=device), torch.empty(0, 2, 64, device=device)
    positions = torch.empty(0, dtype=torch.int32, device=device)
    got_q, got_k = apply_rotary(q, k, positions, torch.zeros(8, 64, device=device))
    assert got_q.shape == (0, 4, 64) and got_k.shape == (0, 2, 64)


def test_rotary_rejects_bad_arguments_with_the_offending_value(device: torch.device) -> None:
    q, k = torch.ones(3, 4, 64, device=device), torch.ones(3, 2, 64, device=device)
    positions = torch.zeros(3, dtype=torch.int32, device=device)
    cos_sin = torch.zeros(8, 64, device=device)
    with pytest.raises(ValueError, match=r"cos_sin must be \[max_positions, 64\]"):
        apply_rotary(q, k, positions, torch.zeros(8, 32, device=device))
    with pytest.raises(TypeError, match=r"positions has dtype torch\.float32"):
        apply_rotary(q, k, positions.float(), cos_sin)
    with pytest.raises(ValueError, match=r"positions must have shape \(3,\)"):
        apply_rotary(q, k, positions[:2], cos_sin)
    with pytest.raises(ValueError, match="must match q"):
        apply_rotary(q, k[:2], positions, cos_sin)
    with pytest.raises(ValueError, match="head_dim 48 is not supported"):
        apply_rotary(q[..., :48], k[..., :48], positions, cos_sin[:, :48])
    with pytest.raises(ValueError, match="q_out must have shape"):
        apply_rotary(q, k, positions, cos_sin, q_out=torch.ones(3, 2, 64, device=device))


# ---- apply_rotary_to_cache ------------------------------------------------------------------


def qkv_and_cache(
    tokens: int, shape: HeadShape, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """`fused_qkv_views`, a random paged cache (3 blocks of 8 slots a token) and distinct slots
    scattered over it, the first block (the engine's null block) unused."""
    q, k, v = fused_qkv_views(tokens, shape, dtype, device)
    cache_shape = (3 * tokens + 1, 8, shape.kv_heads, shape.head_dim)
    k_cache = randn(*cache_shape, dtype=dtype, device=device, seed=6)
    v_cache = randn(*cache_shape, dtype=dtype, device=device, seed=7)
    gen = torch.Generator().manual_seed(8)
    slots = 8 + torch.randperm(k_cache.shape[0] * 8 - 8, generator=gen)[:tokens]
    return q, k, v, k_cache, v_cache, slots.to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [HeadShape(4, 2, 64), HeadShape(32, 8, 128)], ids=str)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_rotary_to_cache_writes_the_slots_the_reference_writes(
    dtype: torch.dtype, device: torch.device, shape: HeadShape, slot_dtype: torch.dtype
) -> None:
    tokens = 11
    q, k, v, k_cache, v_cache, slots = qkv_and_cache(tokens, shape, dtype, device)
    positions, cos_sin = positions_and_table(tokens, shape.head_dim, torch.int64, device)
    k_before, v_before = k.clone(), v.clone()
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    want_q = apply_rotary_to_cache_ref(
        q, k, v, positions, cos_sin, want_k_cache, want_v_cache, slots.to(slot_dtype)
    )
    got_q = apply_rotary_to_cache(
        q, k, v, positions, cos_sin, k_cache, v_cache, slots.to(slot_dtype), q_out=q
    )
    assert got_q.data_ptr() == q.data_ptr() and torch.equal(q, want_q)
    # Every slot equals the reference's: the written ones bit for bit, the others untouched.
    assert torch.equal(k_cache, want_k_cache) and torch.equal(v_cache, want_v_cache)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)
    rotated_k = apply_rotary_ref(q, k, positions, cos_sin)[1]
    assert torch.equal(k_cache.view(-1, shape.kv_heads, shape.head_dim)[slots.long()], rotated_k)
    assert torch.equal(v_cache.view(-1, shape.kv_heads, shape.head_dim)[slots.long()], v)


def test_rotary_to_cache_of_no_tokens_writes_nothing(device: torch.device) -> None:
    q, k, v, k_cache, v_cache, _ = qkv_and_cache(4, HeadShape(4, 2, 64), torch.float32, device)
    before = k_cache.clone()
    cos_sin = torch.zeros(8, 64, device=device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    got = apply_rotary_to_cache(q[:0], k[:0], v[:0], empty, cos_sin, k_cache, v_cache, empty)
    assert got.shape == (0, 4, 64) and torch.equal(k_cache, before)


def test_rotary_to_cache_rejects_bad_caches_and_slots(device: torch.device) -> None:
    q, k, v, k_cache, v_cache, slots = qkv_and_cache(3, HeadShape(4, 2, 64), torch.float32, device)
    positions = torch.zeros(3, dtype=torch.int32, device=device)
    cos_sin = torch.zeros(8, 64, device=device)

    def call(**changes: torch.Tensor) -> None:
        args = {"v": v, "k_cache": k_cache, "v_cache": v_cache, "slots": slots, **changes}
        apply_rotary_to_cache(q, k, positions=positions, cos_sin=cos_sin, **args)

    with pytest.raises(ValueError, match=r"v must have shape \(3, 2, 64\)"):
        call(v=v[:, :1])
    with pytest.raises(ValueError, match=r"v_cache must be \[num_blocks, block_size, 2, 64\]"):
        call(v_cache=v_cache[:2])
    with pytest.raises(ValueError, match=r"k_cache must be \[num_blocks, block_size, 2, 64\]"):
        call(k_cache=k_cache[..., :32].contiguous())
    with pytest.raises(
        ValueError, match=r"v_cache is torch\.float16 but k_cache is torch\.float32"
    ):
        call(v_cache=v_cache.half())
    with pytest.raises(TypeError, match=r"slots has dtype torch\.float32"):
        call(slots=slots.float())
    with pytest.raises(ValueError, match=r"slots must have shape \(3,\)"):
        call(slots=slots[:2])


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
