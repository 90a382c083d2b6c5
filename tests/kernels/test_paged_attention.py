"""paged_attention (Triton) against paged_attention_ref (torch), and both against dense attention."""

from __future__ import annotations

import pytest
import torch
from paged_cases import (
    NUM_KV_HEADS,
    TOLERANCE,
    Batch,
    Cache,
    KernelShape,
    Seq,
    dense_attention,
    dense_paged,
    gather,
    make_batch,
    make_cache,
    over_shapes,
)

from prefixgrove_kernels.launch import PagedMetadata
from prefixgrove_kernels.paged_attention import LONG_QUERY, paged_attention, paged_attention_ref

SHAPES = [
    KernelShape(64, 1, 16),
    KernelShape(64, 4, 8),
    KernelShape(128, 8, 32),
    KernelShape(128, 4, 16),
]


def run(
    attention: object, batch: Batch, cache: Cache, scale: float, **extra: object
) -> torch.Tensor:
    """`extra`: kv_start (None by default) or max_query_len for the metadata, the rest as given."""
    fields = {n: extra.pop(n) for n in ("kv_start", "max_query_len") if n in extra}
    meta = batch.metadata(**{"kv_start": None} | fields)
    out = torch.full_like(batch.q, float("nan"))
    attention(batch.q, cache.k, cache.v, out, meta, scale=scale, **extra)  # type: ignore[operator]
    return out


def check_kernel_ref_dense(
    batch: Batch, cache: Cache, dtype: torch.dtype, with_kv_start: bool = False, **extra: object
) -> None:
    scale = batch.q.shape[2] ** -0.5
    if with_kv_start:
        extra["kv_start"] = batch.kv_start
    got = run(paged_attention, batch, cache, scale, **dict(extra))
    ref = run(paged_attention_ref, batch, cache, scale, **dict(extra))
    dense, _ = dense_paged(batch, cache, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(ref.double().cpu(), dense.cpu(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.double().cpu(), ref.double().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@over_shapes(*SHAPES)
def test_decode_over_ragged_lengths_with_padded_sequences(
    device: torch.device, dtype: torch.dtype, shape: KernelShape
) -> None:
    cache = shape.cache(48, dtype, device)
    lengths = [1, 9, 16, 17, 40, 75]
    seqs = [Seq(1, n) for n in lengths] + [Seq(0, 0), Seq(0, 0)]
    check_kernel_ref_dense(make_batch(cache, seqs, shape.num_heads, dtype), cache, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@over_shapes(KernelShape(64, 4, 8), KernelShape(128, 8, 32))
def test_chunked_prefill_mixed_with_decode_and_prior_context(
    device: torch.device, dtype: torch.dtype, shape: KernelShape
) -> None:
    cache = shape.cache(64, dtype, device)
    seqs = [Seq(0, 12), Seq(1, 30), Seq(7, 7), Seq(19, 50), Seq(33, 54), Seq(2, 2)]
    batch = make_batch(cache, seqs, shape.num_heads, dtype)
    # A padded upper bound on the query length is allowed.
    check_kernel_ref_dense(batch, cache, dtype, max_query_len=40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_equal_chunks_spanning_several_query_tiles(
    device: torch.device, dtype: torch.dtype
) -> None:
    cache = make_cache(32, 16, NUM_KV_HEADS, 64, dtype, device)
    seqs = [Seq(20, 20), Seq(20, 45), Seq(20, 33)]
    check_kernel_ref_dense(make_batch(cache, seqs, NUM_KV_HEADS * 4, dtype), cache, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@over_shapes(KernelShape(64, 1, 16), KernelShape(128, 4, 16))
def test_kv_start_skips_earlier_keys(
    device: torch.device, dtype: torch.dtype, shape: KernelShape
) -> None:
    # The last two start mid key tile and run many tiles past it: the unmasked tiles before the
    # queries, then the causal ones.
    seqs = [Seq(1, 40, 16), Seq(5, 37, 32), Seq(3, 20, 8), Seq(1, 90, 64), Seq(0, 0, 0)]
    seqs += [Seq(1, 150, 24), Seq(9, 140, 40)]
    cache = shape.cache(112, dtype, device)
    batch = make_batch(cache, seqs, shape.num_heads, dtype)
    check_kernel_ref_dense(batch, cache, dtype, with_kv_start=True)


@pytest.mark.parametrize("kv_start", [0, 1000])
def test_contexts_longer_than_one_chunk_of_the_block_table(
    device: torch.device, kv_start: int
) -> None:
    """The unmasked key loop holds the block table in registers 2,048 keys at a time: contexts over
    several chunks, a kv_start inside a chunk and inside a key tile, and a prefill chunk whose query
    tiles end at different keys still see every allowed key once. The last sequence's first query
    tile starts two keys before a key tile ends: that tile must take the causal mask."""
    cache = make_cache(600, 16, NUM_KV_HEADS, 64, torch.float32, device)
    seqs = [Seq(1, 4500, kv_start), Seq(37, 2300, kv_start), Seq(5, 2049, 0), Seq(20, 82, 0)]
    batch = make_batch(cache, seqs, NUM_KV_HEADS * 4, torch.float32)
    check_kernel_ref_dense(batch, cache, torch.float32, with_kv_start=True)


def test_a_long_prefill_beside_suffix_rows(device: torch.device) -> None:
    """A prefill step's launch: a query longer than LONG_QUERY (a new prefix's causal prefill) puts
    every program on the unmasked loop of whole tiles, the suffix rows too, whose keys start at a
    kv_start inside a key tile or on its edge; each row still sees exactly its own keys."""
    cache = make_cache(160, 16, NUM_KV_HEADS, 64, torch.float32, device)
    long = LONG_QUERY + 88
    seqs = [Seq(long, long, 0), Seq(30, 700, 608), Seq(1, 650, 640), Seq(12, 20, 0)]
    batch = make_batch(cache, seqs, NUM_KV_HEADS * 4, torch.float32)
    check_kernel_ref_dense(batch, cache, torch.float32, with_kv_start=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_merge_with_prefix_state_equals_attention_over_all_keys(
    device: torch.device, dtype: torch.dtype
) -> None:
    """The prefix state of keys [0, kv_start) computed densely, the kernel does the rest."""
    cache = make_cache(48, 16, NUM_KV_HEADS, 64, dtype, device)
    seqs = [Seq(1, 40, 16), Seq(6, 70, 32), Seq(2, 2, 0), Seq(1, 33, 32)]
    batch = make_batch(cache, seqs, NUM_KV_HEADS * 4, dtype)
    scale = 0.125
    prefix_o, prefix_lse = [], []
    start = 0
    for s in seqs:
        keys = range(s.kv_start)
        allowed = torch.ones(s.q_len, len(keys), dtype=torch.bool)
        k, v = gather(cache.k, s.blocks, keys), gather(cache.v, s.blocks, keys)
        o, lse = dense_attention(batch.q[start : start + s.q_len], k, v, allowed, scale)
        prefix_o.append(o)
        prefix_lse.append(lse)
        start += s.q_len
    extra = {
        "kv_start": batch.kv_start,
        "prefix_out": torch.cat(prefix_o).float().to(device),
        "prefix_lse": torch.cat(prefix_lse).float().to(device),
    }
    got = run(paged_attention, batch, cache, scale, **dict(extra))
    ref = run(paged_attention_ref, batch, cache, scale, **dict(extra))
    for s in seqs:
        s.kv_start = 0
    whole, _ = dense_paged(batch, cache, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(ref.double().cpu(), whole.cpu(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.double().cpu(), ref.double().cpu(), atol=tol, rtol=tol)


def test_prefix_lse_minus_inf_means_no_prefix(device: torch.device) -> None:
    cache = make_cache(16, 8, NUM_KV_HEADS, 32, torch.float32, device)
    batch = make_batch(cache, [Seq(1, 20, 8), Seq(4, 9, 2)], NUM_KV_HEADS, torch.float32)
    scale = 0.2
    no_prefix = {
        "prefix_out": torch.randn(batch.q.shape, device=device),
        "prefix_lse": torch.full(batch.q.shape[:2], float("-inf"), device=device),
    }
    plain = run(paged_attention, batch, cache, scale, kv_start=batch.kv_start)
    merged = run(paged_attention, batch, cache, scale, kv_start=batch.kv_start, **no_prefix)
    torch.testing.assert_close(merged, plain, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("attention", [paged_attention, paged_attention_ref])
def test_a_prefix_state_merges_only_into_sequences_after_a_prefix(
    device: torch.device, attention: object
) -> None:
    """kv_start 0: outside every group, whatever the state holds is not read (the prefix pass
    leaves those rows unwritten)."""
    cache = make_cache(16, 8, NUM_KV_HEADS, 32, torch.float32, device)
    batch = make_batch(cache, [Seq(3, 20, 0), Seq(4, 9, 5)], NUM_KV_HEADS, torch.float32)
    state = {
        "prefix_out": torch.full(batch.q.shape, float("nan"), device=device),
        "prefix_lse": torch.zeros(batch.q.shape[:2], device=device),
    }
    state["prefix_out"][3:] = 0.5  # the second sequence's rows
    merged = run(attention, batch, cache, 0.2, kv_start=batch.kv_start, **state)
    alone = run(attention, batch, cache, 0.2, kv_start=batch.kv_start)
    torch.testing.assert_close(merged[:3], alone[:3], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(merged[3:], alone[3:])
    with pytest.raises(ValueError, match="prefix_out needs kv_start"):
        run(paged_attention, batch, cache, 0.2, **state)


def test_empty_batch_writes_nothing(device: torch.device) -> None:
    cache = make_cache(4, 8, NUM_KV_HEADS, 32, torch.float32, device)
    batch = make_batch(cache, [Seq(0, 0), Seq(0, 5)], NUM_KV_HEADS, torch.float32)
    out = run(paged_attention, batch, cache, 0.1)
    assert out.shape == (0, NUM_KV_HEADS, 32)


def _valid_args(device: torch.device) -> dict[str, object]:
    cache = make_cache(4, 8, NUM_KV_HEADS, 32, torch.float32, device)
    batch = make_batch(cache, [Seq(1, 5)], NUM_KV_HEADS * 2, torch.float32)
    return {
        "q": batch.q,
        "k_cache": cache.k,
        "v_cache": cache.v,
        "out": torch.empty_like(batch.q),
        "cu_seqlens_q": batch.cu_seqlens_q,
        "seq_lens": batch.seq_lens,
        "block_tables": batch.block_tables,
        "scale": 0.1,
        "max_query_len": 1,
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {"seq_lens": a["seq_lens"].long()}, "seq_lens has dtype torch.int64"),
        (lambda a: {"q": a["q"].repeat(1, 1, 2)[:, :, ::2]}, "q must have unit stride in its last"),
        (lambda a: {"k_cache": a["k_cache"].half()}, "k_cache has dtype torch.float16"),
        (lambda a: {"q": a["q"][:, :3].contiguous()}, "multiple of the cache's num_kv_heads"),
        (lambda a: {"out": a["out"][:, :, :16].contiguous()}, "out must have shape"),
        (
            lambda a: {"block_tables": a["block_tables"][:, :1].repeat(2, 1)},
            "block_tables has 2 rows",
        ),
        (lambda a: {"max_query_len": -1}, "max_query_len must be"),
        (lambda a: {"prefix_lse": torch.zeros(a["q"].shape[:2])}, "given together"),
        (lambda a: {"scale": 0.0}, "scale must be a positive"),
    ],
)
def test_bad_arguments_are_rejected_with_a_clear_message(
    device: torch.device, change: object, message: str
) -> None:
    args = _valid_args(device)
    args.update(change(args))  # type: ignore[operator]
    q, k, v, out = (args.pop(n) for n in ("q", "k_cache", "v_cache", "out"))
    fields = ("cu_seqlens_q", "seq_lens", "block_tables", "max_query_len")
    meta = PagedMetadata(**{n: args.pop(n) for n in fields})  # type: ignore[arg-type]
    with pytest.raises((ValueError, TypeError), match=message):
        paged_attention(q, k, v, out, meta, **args)  # type: ignore[arg-type]


def test_block_size_must_be_a_power_of_two(device: torch.device) -> None:
    q = torch.randn(1, 2, 32, device=device)
    cache = torch.randn(4, 12, 2, 32, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="block_size 12"):
        meta = PagedMetadata(
            cu_seqlens_q=torch.tensor([0, 1]).int().to(device),
            seq_lens=one,
            block_tables=one.view(1, 1),
            max_query_len=1,
        )
        paged_attention(q, cache, cache, torch.empty_like(q), meta, scale=0.1)


@pytest.mark.parametrize("attention", [paged_attention, paged_attention_ref])
def test_queries_and_output_may_be_strided_views(device: torch.device, attention: object) -> None:
    """q as a slice of a fused qkv projection, out as a slice of a wider buffer."""
    cache = make_cache(24, 16, NUM_KV_HEADS, 64, torch.float32, device)
    seqs = [Seq(1, 40, 16), Seq(6, 70), Seq(3, 3)]
    batch = make_batch(cache, seqs, NUM_KV_HEADS * 4, torch.float32)
    num_tokens, num_heads, head_dim = batch.q.shape
    qkv = torch.zeros(num_tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim, device=device)
    qkv[:, : num_heads * head_dim] = batch.q.flatten(1)
    strided_q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    wide = torch.zeros(num_tokens, num_heads * head_dim + 32, device=device)
    strided_out = wide[:, 32:].view(num_tokens, num_heads, head_dim)
    meta = batch.metadata()
    attention(strided_q, cache.k, cache.v, strided_out, meta, scale=0.125)  # type: ignore[operator]
    expected = torch.empty_like(batch.q)
    attention(batch.q, cache.k, cache.v, expected, meta, scale=0.125)  # type: ignore[operator]
    torch.testing.assert_close(strided_out, expected, atol=0, rtol=0)
    assert (wide[:, :32] == 0).all()


@pytest.mark.parametrize("group", [3, 6])
def test_gqa_ratios_that_are_not_powers_of_two(device: torch.device, group: int) -> None:
    cache = make_cache(32, 16, NUM_KV_HEADS, 32, torch.float32, device)
    seqs = [Seq(1, 20), Seq(9, 40, 16), Seq(0, 0), Seq(2, 7)]
    batch = make_batch(cache, seqs, NUM_KV_HEADS * group, torch.float32)
    check_kernel_ref_dense(batch, cache, torch.float32, with_kv_start=True)
