"""The prefix pass of cascade attention (the merge lives in merge_states, fused in the suffix pass).

A prefix group's queries (all its requests' tokens in this step, decode and prefill chunks alike)
are contiguous rows of q. One program takes BLOCK_Q of those rows times the G query heads of one kv
head as the M dimension of tl.dot, so the group's prefix KV is read once per (group, kv head, M tile)
instead of once per request. With few groups the prefix is also split across num_splits programs
(flash-decoding style) whose partial (o, lse) a second kernel reduces.

Rows outside every group (before group_cu_q[0], after group_cu_q[-1], or in a group whose prefix is
empty) get no state (with one split they are left as they were; a split launch's reduce writes
whatever its partial buffers held there): their sequences have kv_start 0, and the suffix pass merges
a prefix state only into sequences whose own keys start after a prefix (kv_start > 0). On a prefill
step those rows are mostly the new prefixes' prompts, often half the step: writing them a state that
says "no prefix" would cost a pass over them here and a read back in the suffix pass.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from prefixgrove_kernels import checks
from prefixgrove_kernels.calls import PrefixCall, takes_arguments_of
from prefixgrove_kernels.launch import CascadeMetadata, KernelLaunch, PagedMetadata, SuffixChunks
from prefixgrove_kernels.merge_states import (
    merge_attention_states,
    merge_attention_states_ref,
    reduce_splits_launch,
)
from prefixgrove_kernels.paged_attention import (
    LOG2E,
    attend_whole_tiles,
    cache_strides,
    finish_rows,
    is_suffix_chunk,
    is_suffix_chunk_host,
    load_keys,
    load_queries,
    online_softmax_step,
    paged_attention_ref,
    score_masked_tile,
    score_queries,
    score_scales,
    scores,
    table_chunk,
    tile_options,
    tile_rows,
    tile_tier,
)
from prefixgrove_kernels.reference_math import attend, causal_window, fp8_query_values, gather_keys
from prefixgrove_kernels.segments import find_owner, search_segments, segment_begin

__all__ = [
    "SuffixChunks",
    "merge_attention_states",
    "merge_attention_states_ref",
    "prefix_attention",
    "prefix_attention_ref",
]

MAX_SPLITS = 16


@triton.jit
def group_row_tile(
    group_cu_ptr, num_groups, num_rows, num_heads, num_splits,
    NUM_QUERIES_PER_KV: tl.constexpr, BLOCK_Q: tl.constexpr,
):  # fmt: skip
    """This program's place on a flat grid of (row tile, split, kv head): its kv head and split,
    its segment's first row and row count, its row tile within the segment, its group (segment - 1)
    and whether the segment is a group at all (segments as in segment_begin)."""
    # Row tiles slowest: every real tile's programs (all kv heads and splits) are dispatched before
    # the empty tiles of padded groups, which would otherwise hold SM slots (their segment search)
    # ahead of real work of later kv heads.
    num_kv_heads = num_heads // NUM_QUERIES_PER_KV
    pid = tl.program_id(0)
    kv_head = pid % num_kv_heads
    split = (pid // num_kv_heads) % num_splits
    tile_idx = pid // (num_kv_heads * num_splits)
    segment = search_segments(group_cu_ptr, tile_idx, num_groups, num_rows, BLOCK_Q, True)
    seg_begin = segment_begin(group_cu_ptr, segment, num_groups, num_rows)
    seg_len = segment_begin(group_cu_ptr, segment + 1, num_groups, num_rows) - seg_begin
    q_tile = tile_idx - (seg_begin // BLOCK_Q + segment)
    is_group = (segment >= 1) & (segment <= num_groups)
    return kv_head, split, seg_begin, seg_len, q_tile, segment - 1, is_group


@triton.jit
def row_sequences(cu_q_ptr, seq_lens_ptr, num_seqs, first, end, token, row_valid):
    """Where query tokens [first, end) (a tile's; `token`: each row's) sit among the step's
    sequences: the tile's first and last sequence, and each row's sequence, first token, query count
    and position. The tile's tokens belong to consecutive sequences (a 32-token tile of 200-token
    chunks: one or two)."""
    s_first = find_owner(cu_q_ptr, first, num_seqs)
    s_last = find_owner(cu_q_ptr, end - 1, num_seqs)
    row_seq = tl.zeros_like(token).to(tl.int32) + s_first
    for s in range(s_first + 1, s_last + 1):
        row_seq += (token >= tl.load(cu_q_ptr + s)).to(tl.int32)
    row_begin = tl.load(cu_q_ptr + row_seq, mask=row_valid, other=0)
    row_q_len = tl.load(cu_q_ptr + row_seq + 1, mask=row_valid, other=0) - row_begin
    row_len = tl.load(seq_lens_ptr + row_seq, mask=row_valid, other=0)
    row_pos = row_len - row_q_len + (token - row_begin).to(tl.int32)
    return s_first, s_last, row_seq, row_begin, row_q_len, row_pos


@triton.jit
def attend_suffix_chunks(
    q, q_scale, k_ptr, v_ptr, v_scale, cu_q_ptr, seq_lens_ptr, kv_start_ptr, seq_tables_ptr, num_seqs,
    first, end, token, row_valid, kv_head, dims, scale_log2, m_i, l_i, acc,
    stride_kb, stride_ks, stride_kh, stride_st, cap_in, cap_out, window,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PV_DTYPE: tl.constexpr, SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    """Folds the own keys of the suffix chunks among query tokens [first, end) into their rows'
    online softmax: each row of such a chunk sees its sequence's keys [kv_start, its position],
    causally (within the window with HAS_WINDOW), and no other sequence's; the tile's sequences
    are walked one after the other. Returns (m, l, acc) and the rows that belong to suffix
    chunks."""
    s_first, s_last, row_seq, row_begin, row_q_len, row_pos = row_sequences(
        cu_q_ptr, seq_lens_ptr, num_seqs, first, end, token, row_valid
    )
    row_kv_start = tl.load(kv_start_ptr + row_seq, mask=row_valid, other=0)
    in_seq = (token - row_begin) < row_q_len  # not a padding row past the last sequence
    chunk_rows = row_valid & in_seq & is_suffix_chunk(row_kv_start, row_q_len)
    for s in range(s_first, s_last + 1):
        begin = tl.load(cu_q_ptr + s)
        q_len = tl.load(cu_q_ptr + s + 1) - begin
        kv_lo = tl.load(kv_start_ptr + s)
        if is_suffix_chunk(kv_lo, q_len):
            # Keys up to the position of s's last token in this tile.
            kv_hi = tl.load(seq_lens_ptr + s) - q_len + tl.minimum(q_len, end - begin)
            table_row = seq_tables_ptr + tl.cast(s, tl.int64) * stride_st
            rows_of_s = (row_seq == s) & chunk_rows
            for tile in range(kv_lo // BLOCK_N, tl.cdiv(kv_hi, BLOCK_N)):
                sc, keys, key_valid, kv_offs = score_masked_tile(
                    q, q_scale, k_ptr, table_row, tile, kv_lo, kv_hi, kv_head, dims,
                    stride_kb, stride_ks, stride_kh, cap_in, cap_out, BLOCK_SIZE, BLOCK_N,
                    DOT_PRECISION, SOFTCAP,
                )  # fmt: skip
                allowed = (
                    key_valid[None, :] & rows_of_s[:, None] & (keys[None, :] <= row_pos[:, None])
                )
                if HAS_WINDOW:
                    allowed &= keys[None, :] > row_pos[:, None] - window
                sc = tl.where(allowed, sc, float("-inf"))
                m_i, l_i, acc = online_softmax_step(
                    sc, scale_log2, v_ptr, v_scale, kv_offs, dims, key_valid, m_i, l_i, acc, True,
                    DOT_PRECISION, PV_DTYPE,
                )  # fmt: skip
    return m_i, l_i, acc, chunk_rows


# Row and group counts change every step: specialising on them (== 1, multiples of 16) would compile a
# new variant mid-run, which costs a second or more each.
@triton.jit(do_not_specialize=["num_groups", "num_tokens", "num_splits", "num_seqs"])
def _prefix_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, HEAD_DIM] (token, head strides free)
    k_ptr,  # k_cache, v_cache: [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_ptr,
    k_scale_ptr,  # an FP8 cache's scales: [1] fp32 each (not read for other caches)
    v_scale_ptr,
    o_ptr,  # [num_splits, num_tokens, num_heads, HEAD_DIM] fp32 (split dim absent if 1: out's dtype)
    lse_ptr,  # [num_splits, num_tokens, num_heads] fp32
    group_cu_ptr,  # [num_groups + 1]
    prefix_lens_ptr,  # [num_groups]
    block_tables_ptr,  # [num_groups, max_prefix_blocks] (row stride stride_bt)
    # With SUFFIX_CHUNKS: the step's sequences (as the paged kernel takes them) and its output
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM] (token, head strides free)
    cu_q_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    kv_start_ptr,  # [num_seqs]
    seq_tables_ptr,  # [num_seqs, max_blocks] (row stride stride_st)
    num_groups,
    num_tokens,
    num_heads,
    num_splits,  # programs per (group tile, kv head) along the prefix (a runtime int: no recompiles)
    num_seqs,
    scale_log2,
    softcap,  # > 0 with SOFTCAP
    window,  # > 0 with HAS_WINDOW: a row at position p sees keys k with p - k < window
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_st,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TABLE_CHUNK: tl.constexpr,
    SUFFIX_CHUNKS: tl.constexpr,  # finish suffix chunks here (see prefix_attention)
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,  # the rows' positions come from the step's sequences (cu_q_ptr, ...)
):
    kv_head, split, seg_begin, seg_len, q_tile, group, is_group = group_row_tile(
        group_cu_ptr, num_groups, num_tokens, num_heads, num_splits, NUM_QUERIES_PER_KV, BLOCK_Q
    )
    if q_tile * BLOCK_Q >= seg_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + group, mask=is_group, other=0)
    if prefix_len == 0:
        # Rows outside every group (and of groups without a prefix) have no prefix state: their
        # sequences have kv_start 0, which the suffix pass reads as "nothing to merge". On a
        # prefill step they are the new prefixes' prompts, often half the step's rows.
        return

    # Over an FP8 cache the scores take e4m3 queries against the bare key codes (k_scale rides on
    # the scores' scale), and the value tiles are scaled here, not folded: this pass is bound by its
    # dots over a whole group's rows, and measures faster so (see paged_attention's docstring).
    scale_log2, v_scale, cap_in, cap_out = score_scales(
        scale_log2, softcap, k_scale_ptr, v_scale_ptr, k_ptr, SOFTCAP
    )

    q_idx, head, row_valid = tile_rows(
        q_tile, kv_head, seg_len, NUM_QUERIES_PER_KV, BLOCK_Q, BLOCK_M
    )
    token = (seg_begin + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q = load_queries(q_ptr, token, head, dims, row_valid, stride_qt, stride_qh)
    q_dot, q_scale = score_queries(q, k_ptr, BLOCK_M)
    first = seg_begin + q_tile * BLOCK_Q
    end = seg_begin + tl.minimum((q_tile + 1) * BLOCK_Q, seg_len)  # one past the tile's last

    num_tiles = tl.cdiv(prefix_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table_row = block_tables_ptr + group.to(tl.int64) * stride_bt
    prefix_blocks = tl.cdiv(prefix_len, BLOCK_SIZE)
    # Tiles before full_hi hold prefix keys only and need no mask (the block table is held in
    # registers a chunk at a time, see attend_whole_tiles); a prefix that ends inside a tile leaves
    # that one tile to the masked step after the loop.
    full_hi = tl.minimum(tile_hi, prefix_len // BLOCK_N)
    masked_lo = tl.maximum(tile_lo, full_hi)
    row_lo = tl.zeros([BLOCK_M], tl.int32)  # each row's first key in its window
    if HAS_WINDOW:
        # The rows (of several sequences) see prefix keys from different places: every tile takes
        # the masked loop, from the tile holding the lowest row's first key.
        row_pos = row_sequences(cu_q_ptr, seq_lens_ptr, num_seqs, first, end, token, row_valid)[5]
        row_lo = row_pos - window + 1
        full_hi = tile_lo
        lowest = tl.min(tl.where(row_valid, row_lo, prefix_len), 0)
        masked_lo = tl.maximum(tile_lo, tl.maximum(lowest, 0) // BLOCK_N)
    m_i, l_i, acc = attend_whole_tiles(
        q_dot, q_scale, k_ptr, v_ptr, v_scale, table_row, tile_lo, full_hi, prefix_blocks,
        kv_head, dims, scale_log2, m_i, l_i, acc, stride_kb, stride_ks, stride_kh, cap_in, cap_out,
        BLOCK_SIZE, BLOCK_N, TABLE_CHUNK, DOT_PRECISION, q.dtype, SOFTCAP,
    )  # fmt: skip
    for tile in range(masked_lo, tile_hi):  # at most one (the prefix's last) without a window
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_valid = keys < prefix_len
        block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_valid, other=0)
        kv_offs = block.to(tl.int64) * stride_kb + (keys % BLOCK_SIZE) * stride_ks
        kv_offs += kv_head * stride_kh
        k = load_keys(k_ptr, kv_offs, dims, key_valid, True, q_dot.dtype)
        s = scores(q_dot, q_scale, k, cap_in, cap_out, DOT_PRECISION, SOFTCAP)
        allowed = key_valid[None, :]
        if HAS_WINDOW:
            allowed = allowed & (keys[None, :] >= row_lo[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(
            s, scale_log2, v_ptr, v_scale, kv_offs, dims, key_valid, m_i, l_i, acc, True,
            DOT_PRECISION, q.dtype,
        )  # fmt: skip

    state_rows = row_valid
    if SUFFIX_CHUNKS:
        # The rows of suffix chunks go on to their own keys in the same online softmax, and their
        # output is final; every other row leaves its prefix state for the suffix pass as before.
        m_i, l_i, acc, chunk_rows = attend_suffix_chunks(
            q_dot, q_scale, k_ptr, v_ptr, v_scale, cu_q_ptr, seq_lens_ptr, kv_start_ptr,
            seq_tables_ptr, num_seqs, first, end, token, row_valid, kv_head, dims, scale_log2, m_i,
            l_i, acc, stride_kb, stride_ks, stride_kh, stride_st, cap_in, cap_out, window,
            BLOCK_SIZE, BLOCK_N, DOT_PRECISION, q.dtype, SOFTCAP, HAS_WINDOW,
        )  # fmt: skip
        state_rows = row_valid & ~chunk_rows
    o, has_keys = finish_rows(acc, l_i, None, k_ptr)
    if SUFFIX_CHUNKS:
        out_offs = token * stride_ot + head * stride_oh
        tl.store(
            out_ptr + out_offs[:, None] + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=chunk_rows[:, None],
        )
    lse = tl.where(
        has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) / 1.4426950408889634, float("-inf")
    )
    lse_offs = (split.to(tl.int64) * num_tokens + token) * num_heads + head
    o_offs = lse_offs * HEAD_DIM
    tl.store(
        o_ptr + o_offs[:, None] + dims[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=state_rows[:, None],
    )
    tl.store(lse_ptr + lse_offs, lse, mask=state_rows)


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached: asked once per device)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tile_shape(head_dim: int, elem_bytes: int, group: int, max_group_q: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): M covers a whole group's rows when it can (up to 128 for narrow rows).
    Narrow-row tiles of decode steps stream 32 keys at a time, four tiles in flight (see
    `_num_stages`): no slower than 64 x 3 at degree 16 and faster at degrees 4 and 64. The widest M
    (a group's prefill chunk) takes 64 keys, two stages and at most 128 registers: faster than
    128 x 32 with three on the canonical prefill (benchmarks/probes/tune_prefill.py; the figures in
    benchmarks/HISTORY.md, "Decode attention kernels" and "Prefill attention")."""
    tier = tile_tier(head_dim, elem_bytes)
    min_m = max(16, triton.next_power_of_2(group))
    block_m = triton.next_power_of_2(max(1, max_group_q * group))
    block_m = min(max(min_m, block_m), max(min_m, 128 >> tier))
    if tier == 0:
        return block_m, 64 if _is_wide(block_m, tier) else 32
    return block_m, 64 >> tier


def _num_stages(block_m: int, tier: int) -> int:
    """Key tiles the pipeliner keeps in flight: wide rows and the wide prefill tiles have room for
    two in shared memory, narrow decode tiles for four."""
    return 4 if tier == 0 and not _is_wide(block_m, tier) else 2


def _is_wide(block_m: int, tier: int) -> bool:
    return tier == 0 and block_m >= 128


def default_num_splits(
    q: torch.Tensor, num_groups: int, m_tiles_per_group: int, num_kv_heads: int
) -> int:
    """About two programs per SM when there are few groups; a power of two (each count is its own
    kernel variant), 1 off the GPU."""
    if q.device.type != "cuda":
        return 1
    programs = max(1, num_groups * m_tiles_per_group * num_kv_heads)
    wanted = min(MAX_SPLITS, triton.cdiv(2 * num_sms(q.device.index or 0), programs))
    return 1 << (max(1, wanted).bit_length() - 1)


def _check_prefix_args(
    call: PrefixCall, kernel: bool = True
) -> tuple[int, int, int, tuple[torch.Tensor, torch.Tensor]]:
    """Validates on the host; returns (num_groups, GQA ratio, the sequences of `_query_seqs` or 0,
    the launch's scale arguments: `checks.kv_scale_args`). kernel: as `checks.check_queries`."""
    group, scales = call.check(kernel)
    q, groups, suffix_chunks = call.q, call.groups, call.suffix_chunks
    num_groups = checks.check_segments(
        q, "group_cu_q", groups.group_cu_q, {"group_prefix_lens": groups.group_prefix_lens},
        "group_block_tables", groups.group_block_tables, "max_group_q", groups.max_group_q,
    )  # fmt: skip
    if call.window and _query_seqs(call) is None:
        raise ValueError(
            f"window={call.window} needs query_seqs (or suffix_chunks): each row's position"
        )
    if suffix_chunks is None:
        if call.query_seqs is None:
            return num_groups, group, 0, scales
        seqs = call.query_seqs
        num_seqs = checks.check_segments(
            q, "query_seqs.cu_seqlens_q", seqs.cu_seqlens_q, {"query_seqs.seq_lens": seqs.seq_lens},
            "query_seqs.block_tables", seqs.block_tables, "num_tokens", q.shape[0],
        )  # fmt: skip
        return num_groups, group, num_seqs, scales
    chunks = suffix_chunks.seqs
    if chunks.kv_start is None:
        raise ValueError("suffix_chunks.seqs needs kv_start (suffix chunks are grouped sequences)")
    checks.check_output("suffix_chunks.out", suffix_chunks.out, q, (q.dtype,), contiguous=False)
    num_seqs = checks.check_segments(
        q, "suffix_chunks.cu_seqlens_q", chunks.cu_seqlens_q,
        {"suffix_chunks.seq_lens": chunks.seq_lens, "suffix_chunks.kv_start": chunks.kv_start},
        "suffix_chunks.block_tables", chunks.block_tables, "num_tokens", q.shape[0],
    )  # fmt: skip
    return num_groups, group, num_seqs, scales


def _query_seqs(call: PrefixCall) -> PagedMetadata | None:
    """The step's sequences the call gives (suffix chunks' or query_seqs), which place its rows."""
    return call.suffix_chunks.seqs if call.suffix_chunks is not None else call.query_seqs


def _outputs(call: PrefixCall) -> tuple[torch.Tensor, torch.Tensor]:
    q, out, out_lse = call.q, call.out, call.out_lse
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if out_lse is None:
        out_lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    checks.check_output("out", out, q, checks.state_dtypes(q))
    checks.check_lse("out_lse", out_lse, q)
    return out, out_lse


def check_num_splits(num_splits: object) -> int:
    if not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    return num_splits


def _prefix_options(
    q: torch.Tensor, k_cache: torch.Tensor, group: int, block_m: int, block_n: int, fused: bool
) -> dict[str, Any]:
    tier = tile_tier(q.shape[2], q.element_size())
    options = tile_options(q, k_cache, group, block_m // group, block_m, block_n) | {
        "TABLE_CHUNK": table_chunk(k_cache.shape[1], block_n),
        "SUFFIX_CHUNKS": fused,
        "num_stages": _num_stages(block_m, tier),
        "num_warps": 8 if block_m * q.shape[2] >= 128 * 128 else 4,
    }
    if _is_wide(block_m, tier):
        # At most 128 registers a thread lets two of these 8-warp programs share an SM (65,536
        # registers), which the prefill chunks' 128-row tiles need to be fast: left alone the
        # compiler takes ~160 for no gain; at 128 nothing spills on sm_90.
        options["maxnreg"] = 128
    return options


@takes_arguments_of(PrefixCall)
def prefix_attention_launches(
    *args: Any, **kwargs: Any
) -> tuple[list[KernelLaunch], torch.Tensor, torch.Tensor]:
    """Checks the arguments and plans the launches `prefix_attention` makes, with its outputs."""
    call = PrefixCall(*args, **kwargs)
    num_groups, group, num_seqs, scales = _check_prefix_args(call)
    out, out_lse = _outputs(call)
    q, k_cache, groups, suffix_chunks = call.q, call.k_cache, call.groups, call.suffix_chunks
    num_splits = call.num_splits
    if suffix_chunks is not None:
        # A suffix chunk's own keys follow its prefix in one program's online softmax.
        if num_splits not in (None, 1):
            raise ValueError(f"suffix_chunks needs num_splits=1, got {num_splits!r}")
        num_splits = 1
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    tile_rows = groups.max_group_q if call.tile_rows is None else call.tile_rows
    block_m, block_n = _tile_shape(head_dim, q.element_size(), group, tile_rows)
    block_q = block_m // group
    if num_splits is None:
        m_tiles = triton.cdiv(tile_rows, block_q)
        num_splits = default_num_splits(q, num_groups, m_tiles, num_kv_heads)
    num_splits = check_num_splits(num_splits)
    if num_tokens == 0:
        return [], out, out_lse
    if num_splits == 1:
        part_o, part_lse = out, out_lse
    else:
        part_o = torch.empty((num_splits, *q.shape), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_splits, *q.shape[:2]), dtype=torch.float32, device=q.device)
    # Without suffix chunks (and a window) their pointers are never read: the call's tensors stand
    # in.
    seqs = _query_seqs(call)
    chunks_out = part_o if suffix_chunks is None else suffix_chunks.out
    chunks = _stand_in_seqs(groups) if seqs is None else seqs
    args = (
        q, k_cache, call.v_cache, *scales, part_o, part_lse,
        groups.group_cu_q, groups.group_prefix_lens, groups.group_block_tables,
        chunks_out, chunks.cu_seqlens_q, chunks.seq_lens,
        chunks.kv_start if chunks.kv_start is not None else chunks.seq_lens, chunks.block_tables,
        num_groups, num_tokens, num_heads, num_splits, num_seqs, call.scale * LOG2E,
        float(call.softcap), call.window,
        q.stride(0), q.stride(1), *cache_strides(k_cache), groups.group_block_tables.stride(0),
        chunks_out.stride(0), chunks_out.stride(1), chunks.block_tables.stride(0),
    )  # fmt: skip
    options = _prefix_options(q, k_cache, group, block_m, block_n, suffix_chunks is not None) | {
        "SOFTCAP": call.softcap > 0,
        "HAS_WINDOW": call.window > 0,
    }
    grid = ((num_tokens // block_q + num_groups + 2) * num_splits * num_kv_heads,)
    launches = [KernelLaunch(_prefix_attention_kernel, grid, args, options)]
    if num_splits > 1:
        launches.append(reduce_splits_launch(part_o, part_lse, out, out_lse))
    return launches, out, out_lse


def _stand_in_seqs(groups: CascadeMetadata) -> PagedMetadata:
    return PagedMetadata(
        cu_seqlens_q=groups.group_cu_q,
        seq_lens=groups.group_prefix_lens,
        block_tables=groups.group_block_tables,
        max_query_len=0,
        kv_start=groups.group_prefix_lens,
    )


@takes_arguments_of(PrefixCall)
def prefix_attention(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of every group's query rows over the group's whole prefix.

    q: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim] (q's dtype, or float8_e4m3fn with k_scale and v_scale, as
    `paged_attention` takes them); groups: the step's prefix groups (index tensors int32). Its
    max_group_q, the largest group's row count, only picks the tile shape and the default split
    count: a group with more rows is still computed whole. Returns (o_p, lse_p): [num_tokens,
    num_heads, head_dim] and [num_tokens, num_heads], written into `out` / `out_lse` when given;
    tile_rows, when given, stands in for max_group_q (a caller that wants one tile shape whatever
    the groups' sizes);
    lse_p is fp32, o_p fp32 unless `out` is in q's dtype (half the bytes to write and read back, at
    one more rounding of o_p). num_splits (1..16) splits each prefix across programs; by default it
    is picked from the GPU's SM count.

    With suffix_chunks, the rows of suffix chunks (grouped sequences with more than one query in the
    step: chunks of their own prompts) go on, in the same pass, to their own keys [kv_start, their
    position] causally, and their final attention over [prefix ; own keys] is written to
    suffix_chunks.out; (o_p, lse_p) of those rows are then left unwritten, and the paged kernel's
    suffix pass (skip_suffix_chunks) takes the other rows. This saves writing and reading back the
    chunks' prefix state and a pass of programs over their few hundred own keys (one split only).
    softcap caps the scores as `paged_attention` does; with window > 0 a row at position p sees the
    prefix keys k with p - k < window only, the positions taken from query_seqs (the step's
    sequences, rows as q's; suffix_chunks' seqs when given): a prefix longer than the window is
    masked where it falls outside it, and a row that sees none of it gets an empty state (lse -inf).
    The grid depends on host ints only, so the call can be captured in a CUDA graph.
    """
    launches, out, out_lse = prefix_attention_launches(*args, **kwargs)
    for launch in launches:
        launch.run()
    return out, out_lse


@takes_arguments_of(PrefixCall)
def prefix_attention_ref(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `prefix_attention` (same contract), one group at a time in fp32; suffix
    chunks are finished by the paged kernel's reference over the prefix state (the merge the
    kernel's one online softmax is equal to)."""
    call = PrefixCall(*args, **kwargs)
    num_groups, _, _, _ = _check_prefix_args(call, kernel=False)
    out, out_lse = _outputs(call)
    q, k_cache, v_cache, groups = call.q, call.k_cache, call.v_cache, call.groups
    cu = groups.group_cu_q.tolist()
    prefix_lens = groups.group_prefix_lens.tolist()
    queries = fp8_query_values(q) if k_cache.dtype == checks.FP8_KV_DTYPE else q
    positions = _row_positions(call)
    for g in range(num_groups):
        if cu[g + 1] == cu[g] or prefix_lens[g] == 0:
            continue
        table = groups.group_block_tables[g]
        k, v = gather_keys(k_cache, v_cache, table, 0, prefix_lens[g], call.k_scale, call.v_scale)
        rows = slice(cu[g], cu[g + 1])
        allowed = torch.ones(cu[g + 1] - cu[g], k.shape[0], dtype=torch.bool, device=q.device)
        if positions is not None:  # prefix keys precede every row: the window alone masks
            key_pos = torch.arange(k.shape[0], device=q.device)
            allowed = causal_window(positions[rows], key_pos, call.window)
        out[rows], out_lse[rows] = attend(queries[rows], k, v, call.scale, allowed, call.softcap)
    if call.suffix_chunks is not None:
        _finish_suffix_chunks_ref(call, call.suffix_chunks, out, out_lse)
    return out, out_lse


def _row_positions(call: PrefixCall) -> torch.Tensor | None:
    """[num_tokens]: each row's position, from the step's sequences, where a window needs it."""
    seqs = _query_seqs(call)
    if not call.window or seqs is None:
        return None
    q_lens = seqs.cu_seqlens_q.diff().long()
    firsts = (seqs.seq_lens.long() - q_lens).repeat_interleave(q_lens)
    starts = seqs.cu_seqlens_q[:-1].long().repeat_interleave(q_lens)
    first_row = int(seqs.cu_seqlens_q[0])
    rows = torch.arange(first_row, first_row + firsts.shape[0], device=firsts.device)
    positions = torch.zeros(call.q.shape[0], dtype=torch.long, device=call.q.device)
    positions[rows] = firsts + rows - starts
    return positions


def _finish_suffix_chunks_ref(
    call: PrefixCall, chunks: SuffixChunks, prefix_out: torch.Tensor, prefix_lse: torch.Tensor
) -> None:
    """The suffix chunks' rows of chunks.out: the suffix pass over their own keys, merged with
    their prefix state, one suffix chunk at a time."""
    seqs = chunks.seqs
    assert seqs.kv_start is not None  # checked with the arguments
    cu = seqs.cu_seqlens_q.tolist()
    starts = seqs.kv_start.tolist()
    for s in range(len(cu) - 1):
        q_len = cu[s + 1] - cu[s]
        if not is_suffix_chunk_host(starts[s], q_len):
            continue
        rows = slice(cu[s], cu[s + 1])
        one = PagedMetadata(
            cu_seqlens_q=seqs.cu_seqlens_q.new_tensor([0, q_len]),
            seq_lens=seqs.seq_lens[s : s + 1],
            block_tables=seqs.block_tables[s : s + 1],
            max_query_len=q_len,
            kv_start=seqs.kv_start[s : s + 1],
        )
        paged_attention_ref(
            call.q[rows], call.k_cache, call.v_cache, chunks.out[rows], one, scale=call.scale,
            prefix_out=prefix_out[rows], prefix_lse=prefix_lse[rows], k_scale=call.k_scale,
            v_scale=call.v_scale, softcap=call.softcap, window=call.window,
        )  # fmt: skip
