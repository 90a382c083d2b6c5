"""The kernels in bf16/fp16 on a real GPU against the fp32 torch reference, on larger shapes.

Tolerances (absolute and relative, on outputs of magnitude <= ~1): bf16 2e-2, fp16 5e-3. The kernel
reads the same rounded K/V as the reference; its extra error comes from rounding the softmax
weights to the input dtype before P @ V and from rounding the output.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from paged_cases import Batch, Cache, Seq, cumulative, int32, make_batch, make_cache

from prefixgrove_kernels.cascade_attention import (
    SuffixChunks,
    merge_attention_states,
    merge_attention_states_ref,
    prefix_attention,
    prefix_attention_ref,
)
from prefixgrove_kernels.cascade_decode import cascade_decode_attention
from prefixgrove_kernels.launch import CascadeMetadata, PagedMetadata
from prefixgrove_kernels.paged_attention import paged_attention, paged_attention_ref

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (tests/conftest.py)

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
LOW_PRECISION = [torch.bfloat16, torch.float16]
NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK = 8, 4, 128, 16


def fp32_copy(cache: Cache) -> Cache:
    return Cache(cache.k.float(), cache.v.float(), [])


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def plain_reference(
    q: torch.Tensor, cache: Cache, meta: PagedMetadata, scale: float
) -> torch.Tensor:
    """The fp32 reference of q's plain paged attention (no cascade) over the cache."""
    want = torch.empty_like(q, dtype=torch.float32)
    wide = fp32_copy(cache)
    paged_attention_ref(q.float(), wide.k, wide.v, want, meta, scale=scale)
    return want


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_decode_and_chunked_prefill_match_the_fp32_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    cache = make_cache(8192, BLOCK, NUM_KV_HEADS, HEAD_DIM, dtype, torch.device("cuda"))
    lengths = torch.randint(1, 2000, (64,), generator=gen).tolist()
    seqs = [Seq(1, n) for n in lengths]
    seqs += [Seq(300, 800), Seq(512, 512), Seq(77, 1500), Seq(0, 0), Seq(0, 0)]
    batch = make_batch(cache, seqs, NUM_KV_HEADS * GROUP, dtype)
    meta, scale = batch.metadata(with_kv_start=False), HEAD_DIM**-0.5
    out = torch.empty_like(batch.q)
    paged_attention(batch.q, cache.k, cache.v, out, meta, scale=scale)
    assert_close(out, plain_reference(batch.q, cache, meta, scale), dtype)


def build_groups(
    cache: Cache, degree: int, prefix_len: int, own_len: int, num_groups: int, dtype: torch.dtype
) -> tuple[Batch, CascadeMetadata]:
    """num_groups groups of `degree` decode requests; returns the batch and its groups."""
    seqs, prefix_tables = [], []
    for _ in range(num_groups):
        shared = cache.take(prefix_len)
        prefix_tables.append(shared)
        seqs += [
            Seq(1, prefix_len + own_len, prefix_len, shared + cache.take(own_len))
            for _ in range(degree)
        ]
    batch = make_batch(cache, seqs, NUM_KV_HEADS * GROUP, dtype)
    device = cache.k.device
    width = max(len(t) for t in prefix_tables)
    tables = torch.zeros(num_groups, width, dtype=torch.int32)
    for g, t in enumerate(prefix_tables):
        tables[g, : len(t)] = torch.tensor(t, dtype=torch.int32)
    groups = CascadeMetadata(
        group_cu_q=cumulative([degree] * num_groups, device),
        group_prefix_lens=int32([prefix_len] * num_groups, device),
        group_block_tables=tables.to(device),
        max_group_q=degree,
    )
    return batch, groups


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize(("degree", "prefix_len", "num_splits"), [(16, 2000, None), (64, 4000, 16)])
def test_cascade_matches_plain_paged_attention_and_the_reference(
    dtype: torch.dtype, degree: int, prefix_len: int, num_splits: int | None
) -> None:
    cache = make_cache(4096, BLOCK, NUM_KV_HEADS, HEAD_DIM, dtype, torch.device("cuda"))
    batch, groups = build_groups(cache, degree, prefix_len, 200, 128 // degree, dtype)
    scale = HEAD_DIM**-0.5
    plain_meta, meta = batch.metadata(with_kv_start=False), batch.metadata()
    plain = torch.empty_like(batch.q)
    paged_attention(batch.q, cache.k, cache.v, plain, plain_meta, scale=scale)
    o_p, lse_p = prefix_attention(
        batch.q, cache.k, cache.v, groups, scale=scale, num_splits=num_splits
    )
    wide = fp32_copy(cache)
    ref_o, ref_lse = prefix_attention_ref(batch.q.float(), wide.k, wide.v, groups, scale=scale)
    torch.testing.assert_close(lse_p, ref_lse, atol=1e-2, rtol=1e-3)
    assert_close(o_p, ref_o, dtype)
    cascade = torch.empty_like(batch.q)
    paged_attention(
        batch.q, cache.k, cache.v, cascade, meta, scale=scale, prefix_out=o_p, prefix_lse=lse_p
    )
    want = torch.empty_like(batch.q, dtype=torch.float32)
    paged_attention_ref(batch.q.float(), wide.k, wide.v, want, plain_meta, scale=scale)
    assert_close(cascade, want, dtype)
    assert_close(plain, want, dtype)
    one_pass = torch.empty_like(batch.q)
    cascade_decode_attention(
        batch.q, cache.k, cache.v, one_pass, meta, groups, scale=scale, num_splits=num_splits
    )
    assert_close(one_pass, want, dtype)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_fused_suffix_chunks_match_the_fp32_reference(dtype: torch.dtype) -> None:
    """A canonical prefill step: groups whose requests bring 200-token chunks of their own prompts
    (and some decode rows), then new prefixes' causal prefills; the prefix pass finishes the chunks,
    the paged launch the rest."""
    cache = make_cache(8192, BLOCK, NUM_KV_HEADS, HEAD_DIM, dtype, torch.device("cuda"))
    seqs, prefix_tables, rows = [], [], []
    for _ in range(4):
        shared = cache.take(2000)
        prefix_tables.append(shared)
        group = [Seq(200, 2200, 2000, shared + cache.take(200)) for _ in range(13)]
        group += [Seq(1, 2000 + n, 2000, shared + cache.take(n)) for n in (201, 230, 250)]
        seqs += group
        rows.append(sum(s.q_len for s in group))
    seqs += [Seq(2000, 2000), Seq(1300, 2000)]  # prefixes of the next groups: plain causal
    batch = make_batch(cache, seqs, NUM_KV_HEADS * GROUP, dtype)
    device = cache.k.device
    groups = CascadeMetadata(
        group_cu_q=cumulative(rows, device),
        group_prefix_lens=int32([2000] * 4, device),
        group_block_tables=torch.tensor(prefix_tables, dtype=torch.int32, device=device),
        max_group_q=max(rows),
    )
    scale = HEAD_DIM**-0.5
    meta = batch.metadata()
    out = torch.empty_like(batch.q)
    o_p, lse_p = prefix_attention(
        batch.q, cache.k, cache.v, groups, scale=scale, out=torch.empty_like(batch.q),
        suffix_chunks=SuffixChunks(out, meta),
    )  # fmt: skip
    paged_attention(
        batch.q, cache.k, cache.v, out, meta, scale=scale, prefix_out=o_p, prefix_lse=lse_p,
        skip_suffix_chunks=True,
    )  # fmt: skip
    want = plain_reference(batch.q, cache, batch.metadata(with_kv_start=False), scale)
    assert_close(out, want, dtype)


def test_merge_kernel_matches_reference_in_bf16() -> None:
    gen = torch.Generator().manual_seed(2)
    shape = (300, 32, HEAD_DIM)
    o_a, o_b = (torch.randn(shape, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    lse_a, lse_b = (torch.randn(shape[:2], generator=gen).cuda() * 4 for _ in range(2))
    lse_a[:10] = float("-inf")
    got = merge_attention_states(o_a, lse_a, o_b, lse_b)
    want = merge_attention_states_ref(o_a, lse_a, o_b, lse_b)
    assert_close(got[0], want[0], torch.bfloat16)
    torch.testing.assert_close(got[1], want[1])


def load_in_place(
    batch: Batch, groups: CascadeMetadata, other: Batch, other_groups: CascadeMetadata
) -> None:
    """Writes a smaller step (one group fewer, the rest padded) into a captured step's buffers:
    queries, kv_start, block tables and groups (the caller sets lengths and offsets)."""
    num_rows, num_groups = other.q.shape[0], other_groups.group_prefix_lens.shape[0]
    batch.q.zero_()[:num_rows] = other.q
    batch.kv_start.zero_()[: len(other.seqs)] = other.kv_start
    rows, cols = other.block_tables.shape
    batch.block_tables[:rows, :cols] = other.block_tables
    last = other_groups.group_cu_q[-1:]
    groups.group_cu_q.copy_(torch.cat([other_groups.group_cu_q, last]))
    groups.group_prefix_lens.zero_()[:num_groups] = other_groups.group_prefix_lens
    prefix_cols = other_groups.group_block_tables.shape[1]
    groups.group_block_tables[:num_groups, :prefix_cols] = other_groups.group_block_tables


def capture(step: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """Runs step once (compiling its kernels outside the capture), then captures it."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def test_cascade_replays_in_a_cuda_graph_with_new_metadata() -> None:
    """Capture once, then change the metadata in place (same shapes): the replay must follow it."""
    dtype = torch.bfloat16
    cache = make_cache(2048, BLOCK, NUM_KV_HEADS, HEAD_DIM, dtype, torch.device("cuda"))
    batch, groups = build_groups(cache, 8, 512, 100, 8, dtype)
    scale = HEAD_DIM**-0.5
    meta = batch.metadata()
    out = torch.empty_like(batch.q)

    def step() -> None:
        o_p, lse_p = prefix_attention(batch.q, cache.k, cache.v, groups, scale=scale)
        paged_attention(
            batch.q, cache.k, cache.v, out, meta, scale=scale, prefix_out=o_p, prefix_lse=lse_p
        )

    graph = capture(step)
    # Same shapes, new contents: other queries, one group fewer (padded), shorter suffixes.
    other, other_groups = build_groups(cache, 8, 256, 40, 7, dtype)
    num_rows = other.q.shape[0]
    batch.cu_seqlens_q.copy_(torch.cat([other.cu_seqlens_q, other.cu_seqlens_q[-1:].repeat(8)]))
    batch.seq_lens.zero_()[: len(other.seqs)] = other.seq_lens
    load_in_place(batch, groups, other, other_groups)
    graph.replay()
    torch.cuda.synchronize()
    want = plain_reference(batch.q, cache, batch.metadata(with_kv_start=False), scale)
    assert_close(out[:num_rows], want[:num_rows], dtype)


def test_one_pass_cascade_decode_replays_in_a_cuda_graph_with_new_metadata() -> None:
    """The one-pass kernel captured once follows new lengths, tables and groups on replay."""
    dtype = torch.bfloat16
    cache = make_cache(2048, BLOCK, NUM_KV_HEADS, HEAD_DIM, dtype, torch.device("cuda"))
    batch, groups = build_groups(cache, 8, 512, 100, 8, dtype)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(batch.q)
    meta = batch.metadata()

    def step() -> None:
        cascade_decode_attention(batch.q, cache.k, cache.v, out, meta, groups, scale=scale)

    graph = capture(step)
    other, other_groups = build_groups(cache, 8, 256, 40, 7, dtype)
    num_rows = other.q.shape[0]
    batch.seq_lens.fill_(1)[:num_rows] = other.seq_lens  # padded rows: one key, as in the engine
    load_in_place(batch, groups, other, other_groups)
    graph.replay()
    torch.cuda.synchronize()
    want = plain_reference(other.q, cache, other.metadata(with_kv_start=False), scale)
    assert_close(out[:num_rows], want, dtype)
