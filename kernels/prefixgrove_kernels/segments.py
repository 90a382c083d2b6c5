"""Binary searches that place a program on a step's query rows. The rows fall into segments (the
sequences, or a cascade step's prefix groups and the rows before and after them) given by cumulative
offsets, and on a grid of query tiles each segment's tiles follow the previous segment's."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def segment_begin(cu_ptr, j, num_groups, num_tokens):
    """Row where segment j of a cascade step begins: segment 0 is [0, cu[0]), j in 1..num_groups is
    group j - 1, segment num_groups + 1 is [cu[num_groups], num_tokens); j = num_groups + 2 ends it
    all."""
    inside = (j >= 1) & (j <= num_groups + 1)
    begin = tl.load(cu_ptr + j - 1, mask=inside, other=0)
    return tl.where(j > num_groups + 1, num_tokens, begin)


@triton.jit
def search_segments(
    cu_ptr, tile_idx, count, num_tokens, BLOCK_Q: tl.constexpr, GROUPS: tl.constexpr
):
    """The segment owning global query tile tile_idx: the largest s with begin(s) // BLOCK_Q + s <=
    tile_idx, where segment s's tiles start. Without GROUPS the segments are `count` sequences and
    begin(s) is cu[s]; with GROUPS they are those of `segment_begin` around `count` groups of a
    step of num_tokens rows (read only then)."""
    lo: tl.int32 = 0
    hi = count + 2 if GROUPS else count
    while lo < hi:
        mid = (lo + hi) // 2
        if GROUPS:
            start = segment_begin(cu_ptr, mid, count, num_tokens) // BLOCK_Q + mid
        else:
            start = tl.load(cu_ptr + mid) // BLOCK_Q + mid
        if start <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def find_owner(cu_ptr, token, num_seqs):
    """The sequence owning a query token: the largest s with cu[s] <= token."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_ptr + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1
