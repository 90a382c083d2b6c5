"""One-pass cascade decode attention: equal to attention over [prefix ; own keys], and to the two-pass path."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from paged_cases import (
    NUM_KV_HEADS,
    TOLERANCE,
    Cache,
    KernelShape,
    Request,
    build_cascade,
    dense_paged,
    make_cache,
    over_shapes,
)

from prefixgrove_kernels.cascade_attention import prefix_attention
from prefixgrove_kernels.cascade_decode import (
    CHUNK_TILES,
    cascade_decode_attention,
    cascade_decode_attention_launches,
    cascade_decode_attention_ref,
)
from prefixgrove_kernels.launch import CascadeMetadata, PagedMetadata
from prefixgrove_kernels.paged_attention import paged_attention


def decode_layout(b: int) -> list[tuple[int, list[Request]]]:
    """Groups of many sizes with ragged own lengths, requests without a prefix before, between and
    after them, and a padded group with no rows."""
    return [
        (0, [Request(1, 20), Request(1, 1)]),  # no prefix (one key: the new token's own)
        (4 * b, [Request(1, n) for n in (10, 25, 1, 3 * b, 3 * b + 1)]),
        (0, [Request(1, 7)]),
        (2 * b, [Request(1, n) for n in range(1, 41, 2)]),  # 20 requests: several row tiles
        (11 * b, [Request(1, 3)]),  # a group of one
        (b, [Request(1, 2 * b), Request(1, 5)]),
        (0, [Request(1, 9), Request(1, 33)]),
        (b, []),
    ]


# The shape of the tests that check one behaviour rather than sweep shapes.
DEFAULT_SHAPE = KernelShape(64, 4, 16)


def setup(
    dtype: torch.dtype,
    shape: KernelShape,
    device: torch.device,
    layout: list[tuple[int, list[Request]]] | None = None,
    num_blocks: int = 160,
) -> tuple[Cache, dict, torch.Tensor]:
    """The cache, the kernel's arguments (q included) and the dense reference for a layout (by
    default decode_layout)."""
    cache = shape.cache(num_blocks, dtype, device)
    layout = layout if layout is not None else decode_layout(shape.block_size)
    batch, groups = build_cascade(cache, layout, shape.num_heads, dtype)
    args = {
        "seq_lens": batch.seq_lens,
        "kv_start": batch.kv_start,
        "block_tables": batch.block_tables,
        "groups": groups.metadata(cache),
        "scale": shape.scale,
    }
    for s in batch.seqs:  # the dense check attends everything a sequence's table holds
        s.kv_start = 0
    dense, _ = dense_paged(batch, cache, shape.scale)
    return cache, {"q": batch.q, **args}, dense


def call(
    attention: Callable[..., None],
    q: torch.Tensor,
    cache: Cache,
    out: torch.Tensor,
    args: dict,
    max_group_q: int,
    **extra: Any,
) -> Any:
    """attention (the kernel, its reference or its launch plan) over setup's arguments."""
    meta = PagedMetadata(
        cu_seqlens_q=torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device),
        seq_lens=args["seq_lens"],
        block_tables=args["block_tables"],
        max_query_len=1,
        kv_start=args["kv_start"],
    )
    groups = dataclasses.replace(args["groups"], max_group_q=max_group_q)
    return attention(q, cache.k, cache.v, out, meta, groups, scale=args["scale"], **extra)


def check_one_pass(
    cache: Cache, args: dict, dense: torch.Tensor, max_group_q: int, num_splits: int
) -> None:
    """The kernel's output (fp32) equals the dense reference."""
    q = args.pop("q")
    out = torch.full_like(q, float("nan"))
    call(cascade_decode_attention, q, cache, out, args, max_group_q, num_splits=num_splits)
    torch.testing.assert_close(out.double().cpu(), dense.cpu(), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize(("max_group_q", "num_splits"), [(1, 1), (4, 3), (16, 1), (16, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@over_shapes(
    KernelShape(64, 4, 16), KernelShape(128, 8, 8), KernelShape(64, 3, 16), KernelShape(32, 1, 8)
)
def test_one_pass_equals_attention_over_prefix_and_own_keys(
    device: torch.device, dtype: torch.dtype, shape: KernelShape, max_group_q: int, num_splits: int
) -> None:
    cache, args, dense = setup(dtype, shape, device)
    q = args.pop("q")
    out = torch.full_like(q, float("nan"))
    call(cascade_decode_attention, q, cache, out, args, max_group_q, num_splits=num_splits)
    ref = torch.empty_like(q)
    call(cascade_decode_attention_ref, q, cache, ref, args, max_group_q)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(ref.double().cpu(), dense.cpu(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.double().cpu(), dense.cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_pass_equals_the_two_pass_cascade(device: torch.device, dtype: torch.dtype) -> None:
    cache, args, _ = setup(dtype, DEFAULT_SHAPE, device)
    q = args.pop("q")
    one_pass = torch.empty_like(q)
    call(cascade_decode_attention, q, cache, one_pass, args, 16)
    groups = dataclasses.replace(args["groups"], max_group_q=16)
    o_p, lse_p = prefix_attention(q, cache.k, cache.v, groups, scale=args["scale"])
    two_pass = torch.empty_like(q)
    meta = PagedMetadata(
        cu_seqlens_q=torch.arange(q.shape[0] + 1, dtype=torch.int32, device=device),
        seq_lens=args["seq_lens"],
        block_tables=args["block_tables"],
        max_query_len=1,
        kv_start=args["kv_start"],
    )
    paged_attention(
        q, cache.k, cache.v, two_pass, meta, scale=args["scale"], prefix_out=o_p, prefix_lse=lse_p
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(one_pass.float(), two_pass.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_streams_longer_than_one_chunk_of_block_ids(device: torch.device, num_splits: int) -> None:
    """The kernel loads CHUNK_TILES tiles' block ids at a time: key streams of several chunks, own
    keys starting mid-block (a prefix that is not whole blocks), and split boundaries inside a
    chunk still attend every key once."""
    chunk_keys = CHUNK_TILES * 64  # fp32 rows of 128 bytes take 64-key tiles
    layout = [
        (2 * chunk_keys + 37, [Request(1, n) for n in (300, 5, chunk_keys + 11)]),
        (0, [Request(1, 70)]),
        (50, [Request(1, 1), Request(1, 129)]),
    ]
    cache, args, dense = setup(torch.float32, KernelShape(32, 2, 16), device, layout, 460)
    check_one_pass(cache, args, dense, max_group_q=3, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_cache_blocks_larger_than_a_key_tile(device: torch.device, num_splits: int) -> None:
    """128-key cache blocks against 64-key tiles: the key stream's units are half blocks, so a unit's
    keys start mid-block; prefixes that end mid-unit put a request's first own key there too."""
    shape = KernelShape(32, 2, 128)
    layout = [
        (shape.block_size + 64 + 5, [Request(1, n) for n in (300, 1, 70, 59)]),
        (0, [Request(1, 130)]),
        (100, [Request(1, 64), Request(1, 129)]),
    ]
    cache, args, dense = setup(torch.float32, shape, device, layout, 40)
    check_one_pass(cache, args, dense, max_group_q=4, num_splits=num_splits)


def test_one_pass_writes_strided_outputs_only_where_it_should(device: torch.device) -> None:
    cache, args, dense = setup(torch.float32, DEFAULT_SHAPE, device)
    q = args.pop("q")
    wide = torch.full((q.shape[0], q.shape[1] + 2, q.shape[2]), 7.0, device=device)
    out = wide[:, 1:-1]  # a strided view, as of a bigger buffer
    call(cascade_decode_attention, q, cache, out, args, 16, num_splits=2)
    torch.testing.assert_close(out.double().cpu(), dense.cpu(), atol=2e-4, rtol=2e-4)
    assert (wide[:, 0] == 7).all() and (wide[:, -1] == 7).all()


def test_one_pass_rejects_bad_arguments(device: torch.device) -> None:
    cache, args, _ = setup(torch.float32, DEFAULT_SHAPE, device)
    q = args.pop("q")
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="num_splits"):
        call(cascade_decode_attention, q, cache, out, args, 4, num_splits=17)
    short = {**args, "seq_lens": args["seq_lens"][:-1]}
    with pytest.raises(ValueError, match="seq_lens"):
        call(cascade_decode_attention, q, cache, out, short, 4)
    fewer_tables = {**args, "block_tables": args["block_tables"][:-1]}
    with pytest.raises(ValueError, match="block_tables"):
        call(cascade_decode_attention, q, cache, out, fewer_tables, 4)
    with pytest.raises(ValueError, match="out"):
        call(cascade_decode_attention, q, cache, out[:-1], args, 4)
    with pytest.raises(ValueError, match="max_group_q"):
        call(cascade_decode_attention, q, cache, out, args, -1)


def test_one_pass_plans_nothing_for_an_empty_batch(device: torch.device) -> None:
    cache = make_cache(8, 16, NUM_KV_HEADS, 64, torch.float32, device)
    q = torch.empty((0, 8, 64), device=device)
    none = torch.zeros(0, dtype=torch.int32, device=device)
    no_rows = torch.zeros((0, 1), dtype=torch.int32, device=device)
    one = torch.zeros(1, dtype=torch.int32, device=device)
    args = {"seq_lens": none, "kv_start": none, "block_tables": no_rows, "scale": 0.125}
    args["groups"] = CascadeMetadata(
        group_cu_q=one, group_prefix_lens=none, group_block_tables=no_rows, max_group_q=1
    )
    launches = call(cascade_decode_attention_launches, q, cache, torch.empty_like(q), args, 1)
    assert launches == []
