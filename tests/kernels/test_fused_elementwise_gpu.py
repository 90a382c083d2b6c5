"""The fused elementwise kernels in bf16 (and fp16) on a real GPU, at Llama-3.1-8B shapes.

Tolerances, in units in the last place (ulps) of the output dtype against the torch reference run
on the same GPU:
- apply_rotary: 0 in bf16/fp16 (same fp32 products and differences, no fused multiply-adds);
- rms_norm: 3 (Triton's rsqrt and reduction order may move the normalised value to a neighbouring
  bf16 value before the weight multiply; one ulp there is at most two after the multiply, plus its
  rounding);
- silu_and_mul: 3 (Triton's exp is the fast ex2-based one, torch's is expf: silu may round to a
  neighbouring value before the multiply by up, the same arithmetic as rms_norm's weight).
Beyond those bounds, at least 99% of elements must equal the reference bit for bit (so every
rounding of the reference is kept). They also replay correctly from a CUDA graph, with new inputs copied into the captured buffers.
"""

from __future__ import annotations

import pytest
import torch
from elementwise_checks import assert_mostly_equal, assert_ulps, randn
from test_fused_rotary import HeadShape, fused_qkv_views

from prefixgrove.engine.models.rotary import rotary_table
from prefixgrove_kernels.activation import silu_and_mul, silu_and_mul_ref
from prefixgrove_kernels.rmsnorm import rms_norm, rms_norm_ref
from prefixgrove_kernels.rotary import (
    apply_rotary,
    apply_rotary_ref,
    apply_rotary_to_cache,
    apply_rotary_to_cache_ref,
)

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (tests/conftest.py)

LOW_PRECISION = [torch.bfloat16, torch.float16]
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4096, 32, 8, 128, 14336
EPS = 1e-5
NORM_ULPS, SILU_ULPS = 3, 3
CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("tokens", [1, 255, 4097])
def test_rms_norm_with_residual_matches_reference(dtype: torch.dtype, tokens: int) -> None:
    x = randn(tokens, HIDDEN, dtype=dtype, device=CUDA) * 3
    residual = randn(tokens, HIDDEN, dtype=dtype, device=CUDA, seed=2)
    weight = randn(HIDDEN, dtype=dtype, device=CUDA, seed=1)
    got, want = rms_norm(x, weight, EPS), rms_norm_ref(x, weight, EPS)
    assert_ulps(got, want, NORM_ULPS)
    assert_mostly_equal(got, want)
    out, new_residual = rms_norm(x, weight, EPS, residual=residual)
    want_out, want_residual = rms_norm_ref(x, weight, EPS, residual=residual)
    assert torch.equal(new_residual, want_residual)
    assert_ulps(out, want_out, NORM_ULPS)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_per_head_norm_and_rotary_on_a_fused_qkv(dtype: torch.dtype) -> None:
    tokens, q_size, kv_size = 999, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = randn(tokens, q_size + 2 * kv_size, dtype=dtype, device=CUDA) * 4
    q = qkv[:, :q_size].view(tokens, HEADS, HEAD_DIM)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, KV_HEADS, HEAD_DIM)
    weight = randn(HEAD_DIM, dtype=dtype, device=CUDA, seed=1)
    want_q = rms_norm_ref(q.reshape(-1, HEAD_DIM), weight, EPS).view(q.shape)
    assert_ulps(rms_norm(q, weight, EPS), want_q, NORM_ULPS)
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    cos_sin = rotary_table(HEAD_DIM, 131072, 500000.0, scaling).to(CUDA)
    positions = torch.randperm(131072, device=CUDA)[:tokens]
    got_q, got_k = apply_rotary(q, k, positions, cos_sin)
    want_q, want_k = apply_rotary_ref(q, k, positions, cos_sin)
    assert_ulps(got_q, want_q, 0)
    assert_ulps(got_k, want_k, 0)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("tokens", [1, 512, 4097])
def test_rotary_to_cache_on_a_fused_qkv_writes_what_the_reference_writes(
    dtype: torch.dtype, tokens: int
) -> None:
    q, k, v = fused_qkv_views(tokens, HeadShape(HEADS, KV_HEADS, HEAD_DIM), dtype, CUDA)
    blocks = 2 * tokens // 16 + 2
    k_cache = randn(blocks, 16, KV_HEADS, HEAD_DIM, dtype=dtype, device=CUDA, seed=2)
    v_cache = randn(blocks, 16, KV_HEADS, HEAD_DIM, dtype=dtype, device=CUDA, seed=3)
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(blocks * 16, device=CUDA)[:tokens]
    positions = torch.randperm(131072, device=CUDA)[:tokens]
    cos_sin = rotary_table(HEAD_DIM, 131072, 500000.0, None).to(CUDA)
    want_q = apply_rotary_to_cache_ref(
        q, k, v, positions, cos_sin, want_k_cache, want_v_cache, slots
    )
    got_q = apply_rotary_to_cache(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    assert_ulps(got_q, want_q, 0)
    assert torch.equal(k_cache, want_k_cache) and torch.equal(v_cache, want_v_cache)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("tokens", [1, 256, 3001])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, tokens: int) -> None:
    x = randn(tokens, 2 * INTERMEDIATE, dtype=dtype, device=CUDA) * 4
    got, want = silu_and_mul(x), silu_and_mul_ref(x)
    assert_ulps(got, want, SILU_ULPS)
    assert_mostly_equal(got, want)


def test_all_three_replay_from_a_cuda_graph() -> None:
    dtype, tokens = torch.bfloat16, 64
    x = randn(tokens, HIDDEN, dtype=dtype, device=CUDA)
    residual = randn(tokens, HIDDEN, dtype=dtype, device=CUDA, seed=2)
    weight = randn(HIDDEN, dtype=dtype, device=CUDA, seed=1)
    gate_up = randn(tokens, 2 * INTERMEDIATE, dtype=dtype, device=CUDA, seed=3)
    q = randn(tokens, HEADS, HEAD_DIM, dtype=dtype, device=CUDA, seed=4)
    k = randn(tokens, KV_HEADS, HEAD_DIM, dtype=dtype, device=CUDA, seed=5)
    positions = torch.arange(tokens, device=CUDA)
    cos_sin = rotary_table(HEAD_DIM, 4096, 500000.0, None).to(CUDA)

    def step() -> tuple[torch.Tensor, ...]:
        normed, summed = rms_norm(x, weight, EPS, residual=residual)
        return normed, summed, *apply_rotary(q, k, positions, cos_sin), silu_and_mul(gate_up)

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (10, 20):
        for buffer in (x, residual, gate_up, q, k):
            buffer.copy_(randn(*buffer.shape, dtype=dtype, device=CUDA, seed=seed))
        positions.copy_(torch.randperm(4096, device=CUDA)[:tokens])
        graph.replay()
        want = step()
        for got, expected in zip(outs, want, strict=True):
            assert torch.equal(got, expected)
