"""Cascade attention: the prefix pass, the merge, and prefix + suffix == plain paged attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_cases import (
    NUM_KV_HEADS,
    TOLERANCE,
    Cache,
    Groups,
    KernelShape,
    Request,
    build_cascade,
    cumulative,
    dense_attention,
    dense_paged,
    gather,
    make_cache,
    over_shapes,
    random_queries,
)

from prefixgrove_kernels.cascade_attention import (
    SuffixChunks,
    merge_attention_states,
    merge_attention_states_ref,
    prefix_attention,
    prefix_attention_ref,
    table_chunk,
)
from prefixgrove_kernels.paged_attention import paged_attention, paged_attention_ref


def dense_prefix(
    q: torch.Tensor, groups: Groups, cache: Cache, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for g, prefix_len in enumerate(groups.prefix_lens):
        rows = slice(groups.cu[g], groups.cu[g + 1])
        keys = range(prefix_len)
        k, v = gather(cache.k, groups.blocks[g], keys), gather(cache.v, groups.blocks[g], keys)
        allowed = torch.ones(groups.cu[g + 1] - groups.cu[g], prefix_len, dtype=torch.bool)
        o[rows], lse[rows] = (t.cpu() for t in dense_attention(q[rows], k, v, allowed, scale))
    return o, lse


def assert_states_close(
    got: tuple[torch.Tensor, torch.Tensor],
    want: tuple[torch.Tensor, torch.Tensor],
    tol: float,
    groups: Groups | None = None,
) -> None:
    """States equal; with groups, on the rows that have one (in a group with a prefix) only."""
    rows: slice | list[int] = slice(None)
    if groups is not None:
        rows = [
            r
            for g, prefix_len in enumerate(groups.prefix_lens)
            if prefix_len > 0
            for r in range(groups.cu[g], groups.cu[g + 1])
        ]
    for a, b in zip(got, want, strict=True):
        a, b = a[rows].double().cpu(), b[rows].double().cpu()
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@over_shapes(KernelShape(64, 4, 8), KernelShape(128, 8, 16), KernelShape(64, 1, 32))
def test_prefix_pass_over_many_groups_mixed_with_ungrouped_rows(
    device: torch.device, dtype: torch.dtype, shape: KernelShape, num_splits: int
) -> None:
    cache = shape.cache(64, dtype, device)
    # 3 ungrouped rows, then groups of 5, 2 (empty prefix), 0, 9 and 1 rows, 2 ungrouped rows,
    # then a padded group with no rows.
    prefix_blocks = [2, 0, 3, 1, 9, 0]
    rows = [5, 2, 0, 9, 1, 0]
    groups = Groups(
        cu=cumulative(rows, device, start=3).tolist(),
        prefix_lens=[n * shape.block_size for n in prefix_blocks],
        blocks=[cache.take(n * shape.block_size) for n in prefix_blocks],
    )
    q = random_queries(3 + sum(rows) + 2, shape.num_heads, shape.head_dim, dtype, device)
    args = {"groups": groups.metadata(cache, 12), "scale": shape.scale}
    nan_state = (
        torch.full(q.shape, float("nan"), device=device),
        torch.full(q.shape[:2], float("nan"), device=device),
    )
    got = prefix_attention(
        q, cache.k, cache.v, num_splits=num_splits, out=nan_state[0].clone(),
        out_lse=nan_state[1].clone(), **args,
    )  # fmt: skip
    ref = prefix_attention_ref(
        q, cache.k, cache.v, out=nan_state[0].clone(), out_lse=nan_state[1].clone(), **args
    )
    dense = dense_prefix(q, groups, cache, shape.scale)
    # Rows outside every group, or of a group without a prefix, get no state (never read).
    tol = TOLERANCE[dtype]
    assert_states_close(ref, dense, tol, groups)
    assert_states_close(got, ref, tol, groups)
    if num_splits == 1:  # one pass leaves them as they were
        stateless = [0, 1, 2, 8, 9, 20, 21]
        assert got[0][stateless].isnan().all() and got[1][stateless].isnan().all()


@pytest.mark.parametrize("max_group_q", [1, 4, 64])
def test_max_group_q_is_only_a_tile_hint(device: torch.device, max_group_q: int) -> None:
    """Decode graphs pass a fixed hint; groups with more rows than it are still computed whole, and
    the wide 128-row tiles a big hint picks give the same states."""
    cache = make_cache(48, 8, NUM_KV_HEADS, 64, torch.float16, device)
    rows, prefix_blocks = [37, 3, 20], [4, 2, 5]
    groups = Groups(
        cu=cumulative(rows, device).tolist(),
        prefix_lens=[n * 8 for n in prefix_blocks],
        blocks=[cache.take(n * 8) for n in prefix_blocks],
    )
    q = random_queries(sum(rows), NUM_KV_HEADS * 4, 64, torch.float16, device)
    got = prefix_attention(q, cache.k, cache.v, groups.metadata(cache, max_group_q), scale=0.125)
    want = dense_prefix(q, groups, cache, 0.125)
    assert_states_close(got, want, TOLERANCE[torch.float16])


def test_prefix_pass_writes_into_given_buffers(device: torch.device) -> None:
    cache = make_cache(8, 8, NUM_KV_HEADS, 32, torch.float32, device)
    groups = Groups(cu=[0, 3], prefix_lens=[16], blocks=[cache.take(16)])
    q = random_queries(3, NUM_KV_HEADS, 32, torch.float32, device)
    out = torch.full(q.shape, float("nan"), device=device)
    out_lse = torch.full(q.shape[:2], float("nan"), device=device)
    args = {"groups": groups.metadata(cache, 3), "scale": 0.1}
    o, lse = prefix_attention(q, cache.k, cache.v, out=out, out_lse=out_lse, **args)
    assert o is out and lse is out_lse
    assert_states_close((o, lse), prefix_attention_ref(q, cache.k, cache.v, **args), 1e-5)


@pytest.mark.parametrize("state_in_query_dtype", [False, True])
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@over_shapes(KernelShape(64, 4, 16), KernelShape(128, 8, 8))
def test_cascade_equals_plain_paged_attention_over_prefix_and_suffix(
    device: torch.device,
    dtype: torch.dtype,
    shape: KernelShape,
    num_splits: int,
    state_in_query_dtype: bool,
) -> None:
    """Also with the prefix pass's output kept in the queries' dtype (what the engine does), which
    the suffix pass reads back and merges in fp32."""
    cache = shape.cache(96, dtype, device)
    b = shape.block_size
    layout = [
        (0, [Request(3, 20)]),  # ungrouped, prefill chunk with context
        (4 * b, [Request(1, 10), Request(1, 25), Request(6, 6), Request(0, 3)]),
        (0, [Request(1, 7)]),  # ungrouped between groups
        (2 * b, [Request(1, 1), Request(5, 12)]),
        (11 * b, [Request(1, 3)]),
        (b, []),  # padded group
    ]
    batch, groups = build_cascade(cache, layout, shape.num_heads, dtype)
    scale = shape.scale
    plain = torch.empty_like(batch.q)
    q, k, v = batch.q, cache.k, cache.v
    paged_attention(q, k, v, plain, batch.metadata(with_kv_start=False), scale=scale)
    meta, prefix_groups = batch.metadata(), groups.metadata(cache, 8)
    cascade, cascade_ref = torch.empty_like(q), torch.empty_like(q)
    for prefix_pass, paged, out, splits in (
        (prefix_attention, paged_attention, cascade, num_splits),
        (prefix_attention_ref, paged_attention_ref, cascade_ref, None),
    ):
        state = torch.empty_like(q) if state_in_query_dtype else None
        o_p, lse_p = prefix_pass(q, k, v, prefix_groups, scale=scale, num_splits=splits, out=state)
        assert o_p.dtype == (dtype if state_in_query_dtype else torch.float32)
        paged(q, k, v, out, meta, scale=scale, prefix_out=o_p, prefix_lse=lse_p)
    for s in batch.seqs:
        s.kv_start = 0
    dense, _ = dense_paged(batch, cache, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(plain.double().cpu(), dense.cpu(), atol=tol, rtol=tol)
    torch.testing.assert_close(cascade.double().cpu(), dense.cpu(), atol=tol, rtol=tol)
    torch.testing.assert_close(cascade_ref.double().cpu(), dense.cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("shape", "max_group_q"),
    [
        (KernelShape(64, 4, 16), 8),
        (KernelShape(128, 8, 8), 16),
        (KernelShape(64, 1, 8), 64),
        (KernelShape(64, 2, 64), 8),
    ],
    ids=str,
)
def test_prefix_pass_finishes_suffix_chunks(
    device: torch.device, dtype: torch.dtype, shape: KernelShape, max_group_q: int
) -> None:
    """The prefix pass takes the suffix chunks (grouped, several queries) on to their own keys and
    writes their output; the paged kernel's suffix pass skips them and finishes the rest (decode rows
    of the same groups, ungrouped sequences) from the prefix state. Together, and as references,
    that is plain attention over prefix and own keys; rows past the last sequence stay untouched.
    The tiles here span several chunks, a chunk over several tiles, and decode rows beside chunks."""
    cache = shape.cache(160, dtype, device)
    b = shape.block_size
    layout = [
        (0, [Request(3, 20)]),  # ungrouped chunk with context
        # a decode row, a chunk after earlier own keys, a short one, a decode row, a first chunk
        (4 * b, [Request(1, 10), Request(7, 25), Request(2, 2), Request(1, 3), Request(13, 13)]),
        (0, [Request(1, 7)]),  # ungrouped decode row between groups
        (2 * b, [Request(3, 12), Request(3, 5), Request(3, 3), Request(3, 9), Request(3, 4)]),
        (11 * b, [Request(40, 41)]),  # one chunk over several tiles
        (b, []),  # padded group
    ]
    batch, groups = build_cascade(cache, layout, shape.num_heads, dtype)
    num_real = batch.q.shape[0]
    padding = random_queries(5, shape.num_heads, shape.head_dim, dtype, device)
    q = torch.cat([batch.q, padding])
    scale = shape.scale
    meta = batch.metadata()
    prefix = {"groups": groups.metadata(cache, max_group_q), "scale": scale}
    outputs = []
    for prefix_pass, paged in (
        (prefix_attention, paged_attention),
        (prefix_attention_ref, paged_attention_ref),
    ):
        out = torch.full_like(q, float("nan"))
        chunks = SuffixChunks(out, meta)
        o_p, lse_p = prefix_pass(
            q, cache.k, cache.v, **prefix, out=torch.empty_like(q), suffix_chunks=chunks
        )
        paged(
            q, cache.k, cache.v, out, meta, scale=scale, prefix_out=o_p, prefix_lse=lse_p,
            skip_suffix_chunks=True,
        )  # fmt: skip
        outputs.append(out)
    for s in batch.seqs:
        s.kv_start = 0
    dense, _ = dense_paged(batch, cache, scale)
    tol = TOLERANCE[dtype]
    for out in outputs:
        torch.testing.assert_close(out[:num_real].double().cpu(), dense.cpu(), atol=tol, rtol=tol)
        assert out[num_real:].isnan().all()


def test_suffix_chunks_need_one_split_and_the_paged_skip_needs_kv_start(
    device: torch.device,
) -> None:
    cache = make_cache(16, 8, NUM_KV_HEADS, 32, torch.float32, device)
    batch, groups = build_cascade(cache, [(16, [Request(3, 5)])], NUM_KV_HEADS, torch.float32)
    out = torch.empty_like(batch.q)
    chunks = SuffixChunks(out, batch.metadata())
    args = {"groups": groups.metadata(cache, 3), "scale": 0.1}
    with pytest.raises(ValueError, match="suffix_chunks needs num_splits=1"):
        prefix_attention(batch.q, cache.k, cache.v, num_splits=2, suffix_chunks=chunks, **args)
    with pytest.raises(ValueError, match=r"suffix_chunks\.block_tables has 2 rows"):
        bad = SuffixChunks(out, batch.metadata(block_tables=batch.block_tables.repeat(2, 1)))
        prefix_attention(batch.q, cache.k, cache.v, suffix_chunks=bad, **args)
    with pytest.raises(ValueError, match="skip_suffix_chunks needs kv_start"):
        no_kv_start = batch.metadata(with_kv_start=False)
        paged_attention(
            batch.q, cache.k, cache.v, out, no_kv_start, scale=0.1, skip_suffix_chunks=True
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merging_states_of_disjoint_key_sets_equals_attention_over_their_union(
    device: torch.device, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(3)
    n_q, num_heads, head_dim = 5, 4, 64
    q = torch.randn(n_q, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(30, 2, head_dim, generator=gen).to(dtype)
    v = torch.randn(30, 2, head_dim, generator=gen).to(dtype)
    in_a = torch.rand(n_q, 30, generator=gen) < 0.4
    in_b = ~in_a
    in_a[0], in_b[1], in_b[2] = False, False, False  # empty sides, and row 2 empty on both
    in_a[2] = False
    a = dense_attention(q, k, v, in_a, 0.125)
    b = dense_attention(q, k, v, in_b, 0.125)
    whole = dense_attention(q, k, v, in_a | in_b, 0.125)
    states = [
        (t.to(dtype) if t.dim() == 3 else t.float()).to(device).contiguous() for t in (*a, *b)
    ]
    got = merge_attention_states(*states)
    ref = merge_attention_states_ref(*states)
    tol = TOLERANCE[dtype]
    assert got[0].dtype == dtype
    assert_states_close(ref, whole, tol)
    assert_states_close(got, ref, tol)
    assert got[1][2].isneginf().all() and (got[0][2] == 0).all()


def test_prefix_pass_rejects_bad_arguments(device: torch.device) -> None:
    cache = make_cache(8, 8, NUM_KV_HEADS, 32, torch.float32, device)
    groups = Groups(cu=[0, 3], prefix_lens=[16], blocks=[cache.take(16)])
    q = random_queries(3, NUM_KV_HEADS, 32, torch.float32, device)
    args = {"groups": groups.metadata(cache, 3), "scale": 0.1}
    with pytest.raises(ValueError, match="num_splits must be an int in"):
        prefix_attention(q, cache.k, cache.v, num_splits=0, **args)
    with pytest.raises(ValueError, match="group_block_tables has 2 rows"):
        tables = args["groups"].group_block_tables.repeat(2, 1)  # type: ignore[attr-defined]
        bad = {**args, "groups": dataclasses.replace(args["groups"], group_block_tables=tables)}
        prefix_attention(q, cache.k, cache.v, **bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"out has dtype torch\.float16"):
        prefix_attention(q, cache.k, cache.v, out=torch.empty_like(q).half(), **args)


def test_prefix_pass_accepts_strided_queries(device: torch.device) -> None:
    cache = make_cache(16, 8, NUM_KV_HEADS, 32, torch.float32, device)
    groups = Groups(cu=[1, 4, 6], prefix_lens=[16, 24], blocks=[cache.take(16), cache.take(24)])
    q = random_queries(7, NUM_KV_HEADS * 2, 32, torch.float32, device)
    qkv = torch.zeros(7, 3, NUM_KV_HEADS * 2, 32, device=device)
    qkv[:, 0] = q
    strided = qkv[:, 0]
    args = {"groups": groups.metadata(cache, 3), "scale": 0.1}
    got = prefix_attention(q, cache.k, cache.v, **args)
    assert_states_close(prefix_attention(strided, cache.k, cache.v, **args), got, 0.0, groups)
    assert_states_close(prefix_attention_ref(strided, cache.k, cache.v, **args), got, 1e-5, groups)


def test_prefix_lengths_need_not_be_whole_blocks(device: torch.device) -> None:
    cache = make_cache(16, 16, NUM_KV_HEADS, 32, torch.float32, device)
    groups = Groups(cu=[0, 2, 5], prefix_lens=[21, 70], blocks=[cache.take(21), cache.take(70)])
    q = random_queries(5, NUM_KV_HEADS * 2, 32, torch.float32, device)
    args = {"groups": groups.metadata(cache, 3), "scale": 0.1}
    dense = dense_prefix(q, groups, cache, 0.1)
    got = prefix_attention(q, cache.k, cache.v, num_splits=2, **args)
    assert_states_close(prefix_attention_ref(q, cache.k, cache.v, **args), dense, 1e-5, groups)
    assert_states_close(got, dense, 1e-5, groups)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefixes_longer_than_one_chunk_of_the_block_table(
    device: torch.device, num_splits: int
) -> None:
    """The kernel holds the block table in registers a chunk at a time; prefixes spanning several
    chunks, with split boundaries inside a chunk, still attend every key once."""
    block_size = 32
    chunk_keys = table_chunk(block_size, 64) * block_size
    prefix_lens = [2 * chunk_keys + 300, chunk_keys + 5]
    cache = make_cache(sum(n // block_size + 1 for n in prefix_lens), block_size, NUM_KV_HEADS, 32,
                       torch.float32, device)  # fmt: skip
    groups = Groups(
        cu=[0, 3, 5], prefix_lens=prefix_lens, blocks=[cache.take(n) for n in prefix_lens]
    )
    q = random_queries(5, NUM_KV_HEADS * 2, 32, torch.float32, device)
    args = {"groups": groups.metadata(cache, 3), "scale": 0.1}
    dense = dense_prefix(q, groups, cache, 0.1)
    got = prefix_attention(q, cache.k, cache.v, num_splits=num_splits, **args)
    assert_states_close(got, dense, 1e-5, groups)


@pytest.mark.parametrize("group", [3, 6])
def test_prefix_pass_with_gqa_ratios_that_are_not_powers_of_two(
    device: torch.device, group: int
) -> None:
    cache = make_cache(16, 8, NUM_KV_HEADS, 32, torch.float32, device)
    groups = Groups(cu=[0, 5, 6], prefix_lens=[40, 16], blocks=[cache.take(40), cache.take(16)])
    q = random_queries(7, NUM_KV_HEADS * group, 32, torch.float32, device)
    args = {"groups": groups.metadata(cache, 5), "scale": 0.1}
    dense = dense_prefix(q, groups, cache, 0.1)
    got = prefix_attention(q, cache.k, cache.v, num_splits=2, **args)
    assert_states_close(prefix_attention_ref(q, cache.k, cache.v, **args), dense, 1e-5, groups)
    assert_states_close(got, dense, 1e-5, groups)
