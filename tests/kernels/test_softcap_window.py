"""Score shaping in every attention kernel (Gemma's layers): soft-capped scores and a sliding window,
the Triton kernels and their torch references against dense float64 attention over each sequence's
whole block table, and the cascade passes with a shared prefix longer than the window."""

from __future__ import annotations

import pytest
import torch
from paged_cases import (
    TOLERANCE,
    Batch,
    Cache,
    KernelShape,
    Request,
    Seq,
    build_cascade,
    gather,
    make_batch,
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
from prefixgrove_kernels.paged_attention import paged_attention, paged_attention_ref

SHAPE = KernelShape(32, 2, 16)
SOFTCAP = 2.0  # small against these scores (~N(0, 1) * sqrt(32) / sqrt(32)): the cap bends them
WINDOW = 20  # shorter than the prefixes below (48 keys) and than the longer prompts
TOL = TOLERANCE[torch.float32]


def dense_shaped(
    batch: Batch, cache: Cache, scale: float, softcap: float, window: int
) -> torch.Tensor:
    """Each sequence's queries over all its keys [0, seq_len) in float64, soft-capped, causal and
    within the window."""
    outs, start = [], 0
    for s in batch.seqs:
        keys = range(s.seq_len)
        group = SHAPE.group
        k = gather(cache.k, s.blocks, keys).double().repeat_interleave(group, dim=1)
        v = gather(cache.v, s.blocks, keys).double().repeat_interleave(group, dim=1)
        q = batch.q[start : start + s.q_len].double()
        x = torch.einsum("qhd,khd->hqk", q, k) * scale
        x = torch.tanh(x / softcap) * softcap if softcap else x
        pos = torch.tensor(list(s.positions))[:, None]
        key = torch.arange(s.seq_len)[None, :]
        allowed = (key <= pos) & ((key > pos - window) if window else True)
        weights = torch.softmax(x.masked_fill(~allowed, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", weights, v))
        start += s.q_len
    return torch.cat(outs)


# Two groups whose 48-key prefixes exceed the window (decode rows, and prompt chunks of several
# queries: some rows see part of the prefix, some none) and a sequence of no group.
NARROW = [
    (48, [Request(1, 3), Request(5, 9), Request(1, 30)]),
    (0, [Request(7, 40)]),
    (48, [Request(12, 12), Request(1, 1)]),
]
# A window of 100 over a 160-key prefix: the rows' windows start in its third and fourth 32-key
# tiles, and its fifth lies inside every row's window (the prefix pass's unmasked loop).
WIDE = [(160, [Request(1, 5), Request(8, 20), Request(1, 40)])]


def cascade_case(
    cache: Cache, layout: list = NARROW, window: int = WINDOW
) -> tuple[Batch, object, torch.Tensor]:
    batch, groups = build_cascade(cache, layout, SHAPE.num_heads, torch.float32)
    for s in batch.seqs:  # the dense check attends all a sequence's table holds
        s.kv_start = 0
    return batch, groups.metadata(cache), dense_shaped(batch, cache, SHAPE.scale, SOFTCAP, window)


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_ref], ids=["triton", "torch"])
@pytest.mark.parametrize(("softcap", "window"), [(SOFTCAP, 0), (0.0, WINDOW), (SOFTCAP, WINDOW)])
def test_paged_attention_caps_scores_and_slides_its_window(fn, softcap: float, window: int):
    cache = SHAPE.cache(40, torch.float32, torch.device("cpu"))
    seqs = [Seq(1, 45), Seq(30, 30), Seq(9, 60), Seq(1, 3)]  # decode, prompt, chunk, short
    batch = make_batch(cache, seqs, SHAPE.num_heads, torch.float32)
    out = torch.empty_like(batch.q)
    meta = batch.metadata(with_kv_start=False)
    fn(batch.q, cache.k, cache.v, out, meta, scale=SHAPE.scale, softcap=softcap, window=window)
    want = dense_shaped(batch, cache, SHAPE.scale, softcap, window)
    assert (out.double() - want).abs().max() < TOL


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_ref], ids=["triton", "torch"])
def test_a_long_prefill_with_a_wide_window_is_windowed_in_whole_and_edge_tiles(fn):
    """A window wider than a key tile (64 keys here): the tiles inside every row's window take the
    kernel's unmasked loop, those its rows' windows cut take the masked one."""
    cache = SHAPE.cache(48, torch.float32, torch.device("cpu"))
    batch = make_batch(cache, [Seq(200, 330), Seq(1, 300)], SHAPE.num_heads, torch.float32)
    out = torch.empty_like(batch.q)
    meta = batch.metadata(with_kv_start=False)
    fn(batch.q, cache.k, cache.v, out, meta, scale=SHAPE.scale, softcap=SOFTCAP, window=150)
    want = dense_shaped(batch, cache, SHAPE.scale, SOFTCAP, 150)
    assert (out.double() - want).abs().max() < TOL


@pytest.mark.parametrize(
    ("layout", "window"), [(NARROW, WINDOW), (WIDE, 100)], ids=["narrow", "wide"]
)
@pytest.mark.parametrize("fused", [False, True], ids=["two-pass", "fused-chunks"])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_cascade_masks_prefix_keys_outside_the_window(
    impl: str, fused: bool, layout: list, window: int
):
    """Prefix pass then suffix pass equal the sequences attended whole: the prefix keys a row's
    window leaves out count for nothing, whether suffix chunks finish in the prefix pass or the
    prefix is split across programs."""
    prefix, paged = (
        (prefix_attention, paged_attention)
        if impl == "triton"
        else (prefix_attention_ref, paged_attention_ref)
    )
    cache = SHAPE.cache(60, torch.float32, torch.device("cpu"))
    batch, groups, want = cascade_case(cache, layout, window)
    meta = batch.metadata()
    out = torch.empty_like(batch.q)
    shaping = {"scale": SHAPE.scale, "softcap": SOFTCAP, "window": window}
    chunks = SuffixChunks(out, meta) if fused else None
    # Unfused, the prefix is split over 3 programs: some of them see no key of a row's window.
    rows = {} if fused else {"query_seqs": meta, "num_splits": 3}
    state = prefix(batch.q, cache.k, cache.v, groups, suffix_chunks=chunks, **rows, **shaping)
    paged(
        batch.q, cache.k, cache.v, out, meta, prefix_out=state[0], prefix_lse=state[1],
        skip_suffix_chunks=fused, **shaping,
    )  # fmt: skip
    assert (out.double() - want).abs().max() < TOL


def test_prefix_pass_with_a_window_needs_the_rows_positions():
    cache = SHAPE.cache(60, torch.float32, torch.device("cpu"))
    batch, groups, _ = cascade_case(cache)
    with pytest.raises(ValueError, match="window=20 needs query_seqs"):
        prefix_attention(batch.q, cache.k, cache.v, groups, scale=1.0, window=WINDOW)


@pytest.mark.parametrize(
    "fn", [cascade_decode_attention, cascade_decode_attention_ref], ids=["triton", "torch"]
)
def test_one_pass_decode_masks_prefix_keys_outside_the_window(fn):
    cache = SHAPE.cache(60, torch.float32, torch.device("cpu"))
    layout = [
        (48, [Request(1, n) for n in (1, 4, 19, 30)]),  # windows inside and across the prefix
        (0, [Request(1, 25)]),
        (48, [Request(1, 2)]),
    ]
    batch, groups = build_cascade(cache, layout, SHAPE.num_heads, torch.float32)
    meta = batch.metadata()
    out = torch.empty_like(batch.q)
    fn(
        batch.q, cache.k, cache.v, out, meta, groups.metadata(cache), scale=SHAPE.scale,
        softcap=SOFTCAP, window=WINDOW, num_splits=2,
    )  # fmt: skip
    for s in batch.seqs:
        s.kv_start = 0
    want = dense_shaped(batch, cache, SHAPE.scale, SOFTCAP, WINDOW)
    assert (out.double() - want).abs().max() < TOL
