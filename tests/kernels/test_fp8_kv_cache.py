"""The FP8 KV cache: the rotary kernel's quantized writes and the attention kernels' dequantized reads.

A cache in float8_e4m3fn holds k / k_scale and v / v_scale; every kernel takes the two scales as fp32
tensors, and its queries in e4m3 too, each row under its own scale (the scores run on the FP8 tensor
cores). The writes must equal the torch reference's bytes; the reads must equal attention of those
queries over the dequantized cache (the references, and a float64 dense attention over the same
values).
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import (
    NUM_KV_HEADS,
    TOLERANCE,
    Cache,
    KernelShape,
    Request,
    Seq,
    build_cascade,
    dense_paged,
    make_batch,
    make_cache,
    over_shapes,
)

from prefixgrove_kernels.cascade_attention import (
    SuffixChunks,
    prefix_attention,
    prefix_attention_ref,
)
from prefixgrove_kernels.cascade_decode import (
    cascade_decode_attention,
    cascade_decode_attention_ref,
)
from prefixgrove_kernels.launch import PagedMetadata
from prefixgrove_kernels.paged_attention import paged_attention, paged_attention_ref
from prefixgrove_kernels.reference_math import dequantize_kv, fp8_query_values, quantize_kv
from prefixgrove_kernels.rotary import (
    apply_rotary_ref,
    apply_rotary_to_cache,
    apply_rotary_to_cache_ref,
)

FP8 = torch.float8_e4m3fn
# (k_scale, v_scale): vLLM's default without calibration, and scales that put the same values (of
# order one) on codes of order 20 to 50
SCALES = [(1.0, 1.0), (0.05, 0.02)]
DTYPES = [torch.float32, torch.float16]  # the interpreter's bf16 tl.dot is broken


def fp8_tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """The kernels' tolerance over an FP8 cache. On the GPU, tiles of 64 query rows or more take
    their scores on the FP8 tensor cores, whose accumulation keeps fewer bits than fp32's (measured
    on the H100: up to 5e-4 from the float64 attention with fp32 queries, 9.5e-3 with fp16); the
    interpreter computes the same products exactly."""
    if device.type == "cuda":
        return {torch.float32: 1e-3, torch.float16: 2e-2}[dtype]
    return TOLERANCE[dtype]


def scale_tensors(k_scale: float, v_scale: float, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        "k_scale": torch.tensor([k_scale], device=device),
        "v_scale": torch.tensor([v_scale], device=device),
    }


def fp8_caches(
    shape: KernelShape, num_blocks: int, scales: dict[str, torch.Tensor], device: torch.device
) -> tuple[Cache, Cache]:
    """A random FP8 cache and its dequantized fp32 copy; the two share their free-block list's
    order, and a batch built on the first reads the same blocks of the second."""
    base = shape.cache(num_blocks, torch.float32, device)
    k8 = quantize_kv(base.k, scales["k_scale"])
    v8 = quantize_kv(base.v, scales["v_scale"])
    exact = Cache(dequantize_kv(k8, scales["k_scale"]), dequantize_kv(v8, scales["v_scale"]), [])
    return Cache(k8, v8, base.free), exact


# ---- the write ------------------------------------------------------------------------------


def rotary_inputs(
    tokens: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    head_dim = 64
    q = torch.randn(tokens, 4, head_dim, generator=gen).to(device, dtype)
    k = (torch.randn(tokens, NUM_KV_HEADS, head_dim, generator=gen) * 3).to(device, dtype)
    # Values across fp16's whole range: e4m3 subnormals, ties, values that saturate, zeros of
    # both signs.
    bits = torch.randint(0, 2**16, (tokens, NUM_KV_HEADS, head_dim), generator=gen)
    v = bits.to(torch.int16).view(torch.float16).float().nan_to_num(0.0, 7e4, -7e4)
    v[0, 0, :6] = torch.tensor([0.0, -0.0, 448.0, -464.0, 1e9, 2.0**-10])
    v = v.clamp(-6e4, 6e4).to(device, dtype)
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(device)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(64).float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
    slots = 8 + torch.randperm(4 * tokens, generator=gen)[:tokens].to(device)
    return q, k, v, positions, cos_sin, slots


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_writes_the_codes_the_reference_writes(
    device: torch.device, dtype: torch.dtype, k_scale: float, v_scale: float
) -> None:
    tokens = 64
    q, k, v, positions, cos_sin, slots = rotary_inputs(tokens, dtype, device)
    scales = scale_tensors(k_scale, v_scale, device)
    cache_shape = (tokens // 2 + 2, 8, NUM_KV_HEADS, 64)
    # Untouched slots keep their bytes: start from random codes (no NaN: below 0x7f in magnitude).
    gen = torch.Generator().manual_seed(1)
    start = torch.randint(0, 0x7F, cache_shape, generator=gen, dtype=torch.uint8)
    caches = [start.clone().view(FP8).to(device) for _ in range(4)]
    want_q = apply_rotary_to_cache_ref(
        q, k, v, positions, cos_sin, caches[0], caches[1], slots, **scales
    )
    got_q = apply_rotary_to_cache(
        q, k, v, positions, cos_sin, caches[2], caches[3], slots, q_out=q.clone(), **scales
    )
    assert torch.equal(got_q, want_q)
    for got, want in ((caches[2], caches[0]), (caches[3], caches[1])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # The written slots decode to the rotated keys and the values, within e4m3's rounding (half a
    # step: 2^-4 relative, 2^-10 x scale among the subnormals) or saturated at 448 x scale.
    rows = slots.long()
    rotated_k = apply_rotary_ref(q, k, positions, cos_sin)[1]
    for cache, x, scale in ((caches[2], rotated_k, k_scale), (caches[3], v, v_scale)):
        codes = cache.view(-1, NUM_KV_HEADS, 64)[rows]
        x = x.float()
        clipped = x.clamp(-448 * scale, 448 * scale)
        decoded = dequantize_kv(codes, torch.tensor(scale))
        assert (decoded - clipped).abs().le(clipped.abs() * 2**-4 + 2**-10 * scale).all()
        saturated = codes.view(torch.uint8)[x.abs() >= 480 * scale]
        assert (saturated & 0x7F).eq(0x7E).all()  # 448's magnitude
    assert v.abs().ge(480 * v_scale).any()  # some values saturate
    untouched = torch.ones(cache_shape[0] * 8, dtype=torch.bool)
    untouched[rows.cpu()] = False
    flat_start = start.view(-1, NUM_KV_HEADS, 64)
    for cache in caches[2:]:
        assert torch.equal(cache.view(torch.uint8).view(-1, NUM_KV_HEADS, 64).cpu()[untouched],
                           flat_start[untouched])  # fmt: skip


def test_rotary_into_a_cache_of_the_model_dtype_takes_no_scales(device: torch.device) -> None:
    q, k, v, positions, cos_sin, slots = rotary_inputs(4, torch.float32, device)
    cache = torch.zeros(4, 8, NUM_KV_HEADS, 64, device=device)
    with pytest.raises(ValueError, match="k_scale and v_scale are for an FP8 cache"):
        apply_rotary_to_cache(
            q, k, v, positions, cos_sin, cache, cache.clone(), slots % 32,
            **scale_tensors(1.0, 1.0, device),
        )  # fmt: skip


# ---- the reads ------------------------------------------------------------------------------


def paged_seqs(block_size: int) -> list[Seq]:
    """Prefill chunks (one longer than a key tile), decode rows, and sequences whose keys start
    after a prefix (kv_start)."""
    b = block_size
    return [
        Seq(1, 3 * b + 5),
        Seq(70, 70),
        Seq(9, 2 * b + 9, kv_start=b),
        Seq(1, 1),
        Seq(33, 4 * b + 1, kv_start=2 * b),
        Seq(1, 5 * b, kv_start=3 * b),
    ]


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
@over_shapes(KernelShape(64, 4, 16), KernelShape(128, 1, 8), KernelShape(32, 3, 16))
def test_paged_attention_over_an_fp8_cache_is_attention_over_its_values(
    device: torch.device, dtype: torch.dtype, shape: KernelShape, k_scale: float, v_scale: float
) -> None:
    scales = scale_tensors(k_scale, v_scale, device)
    cache, exact = fp8_caches(shape, 48, scales, device)
    batch = make_batch(cache, paged_seqs(shape.block_size), shape.num_heads, dtype)
    meta = batch.metadata()
    got = torch.full_like(batch.q, float("nan"))
    paged_attention(batch.q, cache.k, cache.v, got, meta, scale=shape.scale, **scales)
    ref = torch.full_like(batch.q, float("nan"))
    paged_attention_ref(batch.q, cache.k, cache.v, ref, meta, scale=shape.scale, **scales)
    queries = fp8_query_values(batch.q)
    dense, _ = dense_paged(batch, exact, shape.scale, queries)
    tol = fp8_tolerance(dtype, device)
    torch.testing.assert_close(ref.double().cpu(), dense.cpu(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.double().cpu(), dense.cpu(), atol=tol, rtol=tol)
    # The reference over the dequantized cache and queries (in the compute dtype: what the
    # kernel's tiles hold) gives the same output.
    ref_exact = torch.full_like(batch.q, float("nan"))
    paged_attention_ref(
        queries.to(dtype), exact.k.to(dtype), exact.v.to(dtype), ref_exact, meta, scale=shape.scale
    )
    torch.testing.assert_close(got, ref_exact, atol=tol, rtol=tol)


def cascade_layout(b: int) -> list[tuple[int, list[Request]]]:
    """Groups with decode rows and suffix chunks (several queries after the prefix), and rows
    without a prefix."""
    return [
        (0, [Request(1, 20), Request(6, 6)]),
        (4 * b, [Request(1, 10), Request(12, 3 * b + 1), Request(1, 1)]),
        (2 * b, [Request(5, 9), Request(1, 25)]),
        (0, [Request(1, 9)]),
    ]


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["two-pass", "split", "fused", "reference"])
def test_cascade_over_an_fp8_cache_is_attention_over_its_values(
    device: torch.device, dtype: torch.dtype, form: str, k_scale: float, v_scale: float
) -> None:
    """The prefix pass (one or two splits, or finishing the suffix chunks) and the suffix pass that
    merges its state, as the engine runs them, equal attention over each sequence's keys."""
    shape = KernelShape(64, 4, 16)
    scales = scale_tensors(k_scale, v_scale, device)
    cache, exact = fp8_caches(shape, 80, scales, device)
    batch, groups = build_cascade(cache, cascade_layout(16), shape.num_heads, dtype)
    meta, q = batch.metadata(), batch.q
    out = torch.full_like(q, float("nan"))
    args = {"groups": groups.metadata(cache), "scale": shape.scale, **scales}
    prefix, paged = (
        (prefix_attention_ref, paged_attention_ref)
        if form == "reference"
        else (prefix_attention, paged_attention)
    )
    chunks = SuffixChunks(out, meta) if form == "fused" else None
    o_p, lse_p = prefix(
        q, cache.k, cache.v, out=torch.empty_like(q), suffix_chunks=chunks,
        num_splits=2 if form == "split" else 1, **args,
    )  # fmt: skip
    paged(
        q, cache.k, cache.v, out, meta, scale=shape.scale, prefix_out=o_p, prefix_lse=lse_p,
        skip_suffix_chunks=chunks is not None, **scales,
    )  # fmt: skip
    for s in batch.seqs:  # the dense check attends everything a sequence's table holds
        s.kv_start = 0
    dense, _ = dense_paged(batch, exact, shape.scale, fp8_query_values(q))
    tol = fp8_tolerance(dtype, device)
    torch.testing.assert_close(out.double().cpu(), dense.cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_one_pass_decode_over_an_fp8_cache_is_attention_over_its_values(
    device: torch.device, dtype: torch.dtype, num_splits: int, k_scale: float, v_scale: float
) -> None:
    shape = KernelShape(64, 4, 16)
    scales = scale_tensors(k_scale, v_scale, device)
    cache, exact = fp8_caches(shape, 80, scales, device)
    layout = [(0, [Request(1, 20)]), (4 * 16, [Request(1, n) for n in (10, 40, 1, 17)]),
              (16, [Request(1, 3)])]  # fmt: skip
    batch, groups = build_cascade(cache, layout, shape.num_heads, dtype)
    q = batch.q
    meta = PagedMetadata(
        cu_seqlens_q=torch.arange(q.shape[0] + 1, dtype=torch.int32, device=device),
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        max_query_len=1,
        kv_start=batch.kv_start,
    )
    cascade = groups.metadata(cache)
    got = torch.full_like(q, float("nan"))
    cascade_decode_attention(
        q, cache.k, cache.v, got, meta, cascade, scale=shape.scale, num_splits=num_splits,
        **scales,
    )  # fmt: skip
    ref = torch.full_like(q, float("nan"))
    cascade_decode_attention_ref(
        q, cache.k, cache.v, ref, meta, cascade, scale=shape.scale, **scales
    )
    for s in batch.seqs:
        s.kv_start = 0
    dense, _ = dense_paged(batch, exact, shape.scale, fp8_query_values(q))
    tol = fp8_tolerance(dtype, device)
    torch.testing.assert_close(ref.double().cpu(), dense.cpu(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.double().cpu(), dense.cpu(), atol=tol, rtol=tol)


def test_kernels_reject_missing_misplaced_and_malformed_scales(device: torch.device) -> None:
    shape = KernelShape(32, 1, 8)
    scales = scale_tensors(1.0, 1.0, device)
    cache, _ = fp8_caches(shape, 8, scales, device)
    batch = make_batch(cache, [Seq(2, 5)], shape.num_heads, torch.float32)
    out = torch.empty_like(batch.q)

    def call(k: torch.Tensor, v: torch.Tensor, **extra: torch.Tensor) -> None:
        paged_attention(batch.q, k, v, out, batch.metadata(), scale=0.1, **extra)

    with pytest.raises(ValueError, match=r"an FP8 cache .* needs k_scale and v_scale"):
        call(cache.k, cache.v)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        call(cache.k, cache.v, k_scale=scales["k_scale"])
    plain = make_cache(8, 8, NUM_KV_HEADS, 32, torch.float32, device)
    with pytest.raises(ValueError, match="k_scale and v_scale are for an FP8 cache"):
        call(plain.k, plain.v, **scales)
    with pytest.raises(TypeError, match=r"v_cache is torch\.float32 but k_cache is .*float8"):
        call(cache.k, plain.v, **scales)
    with pytest.raises(TypeError, match=r"k_scale has dtype torch\.float16"):
        call(cache.k, cache.v, k_scale=scales["k_scale"].half(), v_scale=scales["v_scale"])
    with pytest.raises(ValueError, match=r"v_scale must hold one value .*\(2,\)"):
        call(cache.k, cache.v, k_scale=scales["k_scale"], v_scale=scales["v_scale"].repeat(2))
    with pytest.raises(TypeError, match=r"k_cache has dtype torch\.float8_e5m2"):
        call(cache.k.view(torch.float8_e5m2), cache.v.view(torch.float8_e5m2), **scales)


def test_queries_over_an_fp8_cache_are_their_rows_in_e4m3() -> None:
    """What the kernels (and the references) take q as: each row (one token's head) on the e4m3 grid
    of its own scale (amax / 448), its largest magnitude kept, within half an e4m3 step of q; an
    all-zero row stays zero."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(6, 4, 64, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1e3])[None, :, None]
    q[2, 1] = 0.0
    q = q.to(torch.float16).float()
    values = fp8_query_values(q)
    scale = (q.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-12)
    codes = values / scale
    torch.testing.assert_close(codes, codes.to(FP8).float(), rtol=1e-6, atol=0)  # on the grid
    torch.testing.assert_close(values.abs().amax(-1), q.abs().amax(-1), rtol=1e-6, atol=0)
    assert torch.equal(values[2, 1], torch.zeros(64))
    # Half a step: 2^-4 of the value in e4m3's normal range, 2^-10 (of 448) among its subnormals.
    half_step = torch.maximum((q / scale).abs() * 2.0**-4, torch.tensor(2.0**-10))
    assert ((codes - q / scale).abs() <= half_step * (1 + 1e-6)).all()
    assert (values != q).any()
