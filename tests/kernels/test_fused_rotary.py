"""apply_rotary and apply_rotary_to_cache (Triton) against their torch references, fp32 and fp16:
rotary rounds exactly like the reference, on views of a fused qkv and into the paged cache's slots."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from elementwise_checks import (
    DTYPES,
    randn,
)

from prefixgrove.engine.models.rotary import rotary_table
from prefixgrove_kernels.rotary import (
    apply_rotary,
    apply_rotary_ref,
    apply_rotary_to_cache,
    apply_rotary_to_cache_ref,
)

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
