"""Cascade attention for decode steps in one pass: a group's prefix and its requests' own keys in one stream.

In a decode step every request has one query row. The two-pass cascade (prefix pass, then a suffix pass
per request that merges) reads each prefix once per group, but its suffix pass is many short programs
(a few hundred keys each) that spend much of their life starting up and draining, and the two launches
leave each other's tails idle. Here one program takes BLOCK_Q requests of a group (times the G query
heads of one kv head as the M dimension of tl.dot) and walks one dense stream of keys: the group's
prefix, then each request's own keys, packed in whole key tiles (a tile may end one request's keys and
start the next one's). Prefix keys are allowed for every row; a request's own keys only for its own
rows (the rows of the others are masked, which costs tensor-core work that is free here, where the
bound is memory). One online softmax covers the whole stream, so there is nothing
to merge; long streams are split across num_splits programs whose partial results a small kernel
reduces. Rows outside every group (requests without a prefix) form prefix-less segments and work the
same way.

Same metadata as the two-pass path (rows = sequences: row i is sequence i's only query): the
sequences' PagedMetadata (seq_lens, kv_start: the first own key of each request, its group's prefix
length or 0 without one, block_tables) and the groups' CascadeMetadata.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from prefixgrove_kernels import checks
from prefixgrove_kernels.calls import DecodeCall, takes_arguments_of
from prefixgrove_kernels.cascade_attention import (
    MAX_SPLITS,
    check_num_splits,
    group_row_tile,
    num_sms,
)
from prefixgrove_kernels.launch import KernelLaunch
from prefixgrove_kernels.merge_states import reduce_splits_launch
from prefixgrove_kernels.paged_attention import (
    LOG2E,
    cache_strides,
    finish_rows,
    load_keys,
    load_queries,
    online_softmax_step,
    queries_for_cache,
    score_queries,
    score_scales,
    scores,
    tile_options,
    tile_tier,
)
from prefixgrove_kernels.reference_math import attend, causal_window, fp8_query_values, gather_keys

__all__ = ["cascade_decode_attention", "cascade_decode_attention_ref"]


# Key tiles whose block ids and key codes a program loads into registers at a time (32 was the
# fastest of 16, 32 and 64 at degree 16 / 2,000 tokens on the H100).
CHUNK_TILES = 32

# A key code packs what the key loop needs of each unit besides its block id (see the kernel).
_OWNER_SHIFT = tl.constexpr(24)  # the request of the tile it belongs to (BLOCK_Q: the prefix)
_SUB_SHIFT = tl.constexpr(14)  # which unit of its cache block it is
_LO_SHIFT = tl.constexpr(7)  # the first and end key of it that count (7 bits each: UNIT <= 64)


def key_unit(block_size: int, block_n: int) -> int:
    """Keys per unit of the dense key stream: a cache block, or a tile's worth of one."""
    return min(block_size, block_n)


@triton.jit
def _per_unit(pick, member_values):
    """member_values[j] for each unit, where pick[u, j] marks unit u's request j (registers only)."""
    return tl.sum(tl.where(pick, member_values[None, :], 0), 1)


# Row, group and split counts change every step: no specialisation on them (see cascade_attention).
@triton.jit(do_not_specialize=["num_groups", "num_seqs", "num_splits"])
def _cascade_decode_kernel(
    q_ptr,  # q, out: [num_seqs, num_heads, HEAD_DIM] (token, head strides free)
    k_ptr,  # k_cache, v_cache: [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_ptr,
    k_scale_ptr,  # an FP8 cache's scales: [1] fp32 each (not read for other caches)
    v_scale_ptr,
    out_ptr,
    part_o_ptr,  # [num_splits, num_seqs, num_heads, HEAD_DIM] fp32 (SPLIT only)
    part_lse_ptr,  # [num_splits, num_seqs, num_heads] fp32 (SPLIT only)
    seq_lens_ptr,  # [num_seqs]
    kv_start_ptr,  # [num_seqs]
    block_tables_ptr,  # [num_seqs, max_blocks] (row stride stride_bt)
    group_cu_ptr,  # [num_groups + 1]
    prefix_lens_ptr,  # [num_groups]
    group_tables_ptr,  # [num_groups, max_prefix_blocks] (row stride stride_gt)
    num_groups,
    num_seqs,
    num_heads,
    num_splits,
    scale_log2,
    softcap,  # > 0 with SOFTCAP
    window,  # > 0 with HAS_WINDOW: row s (at position seq_lens[s] - 1) sees keys k with p - k < window
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    stride_gt,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNIT: tl.constexpr,
    CHUNK_TILES: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    kv_head, split, seg_begin, seg_len, q_tile, group, is_group = group_row_tile(
        group_cu_ptr, num_groups, num_seqs, num_heads, num_splits, NUM_QUERIES_PER_KV, BLOCK_Q
    )
    if q_tile * BLOCK_Q >= seg_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + group, mask=is_group, other=0)

    # The key stream, dense: the prefix's keys, then each request's own keys [kv_start, seq_len),
    # in units of UNIT keys that lie in one cache block (a request's last unit may be partial; its
    # first too when its own keys start mid-block). Tiles take UNITS_PER_TILE consecutive units, so a
    # tile holds the end of one request's keys and the start of the next: a request's 200 own keys
    # take 13 units, not 4 tiles of which the last holds 8 keys.
    UNITS_PER_TILE: tl.constexpr = BLOCK_N // UNIT
    UNITS_PER_BLOCK: tl.constexpr = BLOCK_SIZE // UNIT
    CHUNK_UNITS: tl.constexpr = CHUNK_TILES * UNITS_PER_TILE
    members = tl.arange(0, BLOCK_Q)
    first_seq = seg_begin + q_tile * BLOCK_Q
    member_valid = q_tile * BLOCK_Q + members < seg_len
    own_end = tl.load(seq_lens_ptr + first_seq + members, mask=member_valid, other=0)
    own_begin = tl.load(kv_start_ptr + first_seq + members, mask=member_valid, other=0)
    own_first_unit = own_begin // UNIT
    own_units = tl.where(own_end > own_begin, (own_end + UNIT - 1) // UNIT - own_first_unit, 0)
    own_cum = tl.cumsum(own_units, 0)  # units up to and including each request
    # Unit u of request j's own run is its key unit own_first_unit + u: the offset to add.
    own_shift = own_first_unit - (own_cum - own_units)
    prefix_units = (prefix_len + UNIT - 1) // UNIT
    num_units = prefix_units + tl.sum(own_units, 0)
    num_tiles = (num_units + UNITS_PER_TILE - 1) // UNITS_PER_TILE
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    unit_hi = tl.minimum(tile_hi * UNITS_PER_TILE, num_units)

    scale_log2, v_scale, cap_in, cap_out = score_scales(
        scale_log2, softcap, k_scale_ptr, v_scale_ptr, k_ptr, SOFTCAP
    )

    # Row r of the M dimension is request r // G of this tile, head kv_head * G + r % G.
    rows = tl.arange(0, BLOCK_M)
    row_member = rows // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_tile * BLOCK_Q + row_member < seg_len)
    token = (first_seq + row_member).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q = load_queries(q_ptr, token, head, dims, row_valid, stride_qt, stride_qh)
    q_dot, q_scale = score_queries(q, k_ptr, BLOCK_M)
    row_lo = tl.zeros([BLOCK_M], tl.int32)  # each row's first key in its window
    if HAS_WINDOW:  # a row's position is its sequence's last
        row_lo = tl.load(seq_lens_ptr + token, mask=row_valid, other=0) - window
    q = queries_for_cache(q, k_ptr)  # for the p @ v dots' dtype

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    group_row = group_tables_ptr + group.to(tl.int64) * stride_gt
    # Each chunk of CHUNK_TILES tiles works out its units' block ids and key codes as vectors, once,
    # in registers; each tile gathers its keys' from there. So the key and value loads depend on no
    # other load and the pipeliner keeps the next tiles' copies in flight.
    unit_slots = tl.arange(0, CHUNK_UNITS)
    key_unit_idx = tl.arange(0, BLOCK_N) // UNIT
    key_in_unit = tl.arange(0, BLOCK_N) % UNIT
    for chunk_lo in range(tile_lo, tile_hi, CHUNK_TILES):
        units = chunk_lo * UNITS_PER_TILE + unit_slots
        u_in_prefix = units < prefix_units
        u_own = units - prefix_units
        u_member = tl.sum((own_cum[None, :] <= u_own[:, None]).to(tl.int32), 1)
        u_pick = members[None, :] == u_member[:, None]
        u_shift = _per_unit(u_pick, own_shift)
        u_begin = _per_unit(u_pick, own_begin)
        u_end = _per_unit(u_pick, own_end)
        # The unit's index among its table row's key units, and the keys of it that count.
        u_index = tl.where(u_in_prefix, units, u_own + u_shift)
        u_key = u_index * UNIT
        lo = tl.where(u_in_prefix, 0, tl.maximum(u_begin - u_key, 0))
        hi = tl.minimum(tl.where(u_in_prefix, prefix_len, u_end) - u_key, UNIT)
        live = units < unit_hi
        u_rows = tl.where(
            u_in_prefix,
            group_row,
            block_tables_ptr + (first_seq + u_member).to(tl.int64) * stride_bt,
        )
        chunk_ids = tl.load(u_rows + u_index // UNITS_PER_BLOCK, mask=live, other=0)
        chunk_keys = u_key  # each unit's first key position (prefix and own keys alike)
        owner = tl.where(u_in_prefix, BLOCK_Q, u_member)
        chunk_codes = (
            (owner << _OWNER_SHIFT)
            | ((u_index % UNITS_PER_BLOCK) << _SUB_SHIFT)
            | (lo << _LO_SHIFT)
            | tl.where(live, hi, 0)
        )
        for tile in range(chunk_lo, tl.minimum(chunk_lo + CHUNK_TILES, tile_hi)):
            # Wrapped into the chunk: the pipeliner computes this for tiles past the loop's end too
            # (their loads are masked off), and a gather index out of range faults on the GPU.
            slot = ((tile - chunk_lo) * UNITS_PER_TILE + key_unit_idx) & (CHUNK_UNITS - 1)
            block = tl.gather(chunk_ids, slot, 0)
            code = tl.gather(chunk_codes, slot, 0)
            key_owner = code >> _OWNER_SHIFT
            key_valid = (key_in_unit >= ((code >> _LO_SHIFT) & 127)) & (key_in_unit < (code & 127))
            in_block = ((code >> _SUB_SHIFT) & 1023) * UNIT + key_in_unit
            kv_offs = block.to(tl.int64) * stride_kb + in_block * stride_ks + kv_head * stride_kh
            k = load_keys(k_ptr, kv_offs, dims, key_valid, True, q_dot.dtype)
            s = scores(q_dot, q_scale, k, cap_in, cap_out, DOT_PRECISION, SOFTCAP)
            # Prefix keys count for every row; a request's own keys for its own rows only.
            allowed = key_valid[None, :] & (
                (key_owner == BLOCK_Q)[None, :] | (row_member[:, None] == key_owner[None, :])
            )
            if HAS_WINDOW:  # a unit's keys are consecutive positions from its first
                key_pos = tl.gather(chunk_keys, slot, 0) + key_in_unit
                allowed &= key_pos[None, :] >= row_lo[:, None]
            s = tl.where(allowed, s, float("-inf"))
            m_i, l_i, acc = online_softmax_step(
                s, scale_log2, v_ptr, None, kv_offs, dims, key_valid, m_i, l_i, acc, True,
                DOT_PRECISION, q.dtype,
            )  # fmt: skip

    o, has_keys = finish_rows(acc, l_i, v_scale, k_ptr)
    if SPLIT:
        log2_l = tl.log2(tl.where(has_keys, l_i, 1.0))
        lse = tl.where(has_keys, (m_i + log2_l) / 1.4426950408889634, float("-inf"))
        state = (split.to(tl.int64) * num_seqs + token) * num_heads + head
        tl.store(part_o_ptr + state[:, None] * HEAD_DIM + dims[None, :], o, mask=row_valid[:, None])
        tl.store(part_lse_ptr + state, lse, mask=row_valid)
    else:
        o_offs = token * stride_ot + head * stride_oh
        tl.store(
            out_ptr + o_offs[:, None] + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )


def _check_args(
    call: DecodeCall, kernel: bool = True
) -> tuple[int, int, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Validates on the host; returns (num_groups, GQA ratio, kv_start, the launch's scale
    arguments: `checks.kv_scale_args`). kernel: as `checks.check_queries`."""
    group, scales = call.check(kernel)
    q, meta, groups = call.q, call.meta, call.groups
    checks.check_output("out", call.out, q, q.dtype, contiguous=False)
    if meta.kv_start is None:
        raise ValueError("cascade decode needs meta.kv_start (each sequence's first own key)")
    num_seqs = q.shape[0]  # one query row per sequence
    for name, vector in (("seq_lens", meta.seq_lens), ("kv_start", meta.kv_start)):
        checks.check_index(name, vector, ndim=1, device=q.device)
        checks.check_shape(name, vector, (num_seqs,))
    checks.check_index("block_tables", meta.block_tables, ndim=2, device=q.device)
    if meta.block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables has {meta.block_tables.shape[0]} rows for {num_seqs} sequences"
        )
    num_groups = checks.check_segments(
        q, "group_cu_q", groups.group_cu_q, {"group_prefix_lens": groups.group_prefix_lens},
        "group_block_tables", groups.group_block_tables, "max_group_q", groups.max_group_q,
    )  # fmt: skip
    return num_groups, group, meta.kv_start, scales


def _tile_shape(
    head_dim: int, elem_bytes: int, group: int, max_group_q: int
) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_M, BLOCK_N): as many of a group's requests per program as 64 rows hold (16 at GQA 4
    and head_dim 128), so its prefix is read by as few programs as possible. BLOCK_Q is a power of two
    (a tl.arange); BLOCK_M covers BLOCK_Q * G rows, also for ratios that are not powers of two."""
    tier = tile_tier(head_dim, elem_bytes)
    max_rows = max(16, triton.next_power_of_2(group), 64 >> tier)
    fit = 1 << ((max_rows // group).bit_length() - 1)  # the largest power of two <= max_rows // G
    block_q = min(triton.next_power_of_2(max(1, max_group_q)), fit)
    return block_q, max(16, triton.next_power_of_2(block_q * group)), 64 >> tier


def _default_num_splits(q: torch.Tensor, programs: int, block_m: int) -> int:
    """The most splits (a power of two) that keep programs x splits within 0.8 x SMs x k, k = 2 for
    64-row tiles, 3 for 32, 5 for 16: fewer leave SMs idle, more only shorten every program's stream.
    An empirical rule (benchmarks/attention_kernels.py, H100): since the key loop pipelines its copies,
    a 64-row program takes 116 KB of shared memory and the SM holds one, and the rule still picks the
    fastest count at degree 16 / 2,000 tokens (benchmarks/HISTORY.md, "Decode attention kernels")."""
    if q.device.type != "cuda":
        return 1
    resident = num_sms(q.device.index or 0) * (2 if block_m >= 64 else 3 if block_m >= 32 else 5)
    splits = 1
    while splits < MAX_SPLITS and programs * splits * 2 <= resident * 1.6:
        splits *= 2
    return splits


@takes_arguments_of(DecodeCall)
def cascade_decode_attention_launches(*args: Any, **kwargs: Any) -> list[KernelLaunch]:
    """Checks the arguments and plans the launches `cascade_decode_attention` makes."""
    call = DecodeCall(*args, **kwargs)
    num_groups, group, kv_start, scales = _check_args(call)
    q, k_cache, out, meta, groups = call.q, call.k_cache, call.out, call.meta, call.groups
    num_splits = call.num_splits
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    block_q, block_m, block_n = _tile_shape(head_dim, q.element_size(), group, groups.max_group_q)
    if num_splits is None:
        num_splits = _default_num_splits(q, (num_seqs // block_q + 1) * num_kv_heads, block_m)
    num_splits = check_num_splits(num_splits)
    if num_seqs == 0:
        return []
    split = num_splits > 1
    if split:
        part_o = torch.empty((num_splits, *q.shape), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_splits, *q.shape[:2]), dtype=torch.float32, device=q.device)
    else:
        part_o, part_lse = out, meta.seq_lens  # unused
    args = (
        q, k_cache, call.v_cache, *scales, out, part_o, part_lse, meta.seq_lens, kv_start,
        meta.block_tables, groups.group_cu_q, groups.group_prefix_lens, groups.group_block_tables,
        num_groups, num_seqs, num_heads, num_splits, call.scale * LOG2E, float(call.softcap),
        call.window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides(k_cache),
        meta.block_tables.stride(0), groups.group_block_tables.stride(0),
    )  # fmt: skip
    options = tile_options(q, k_cache, group, block_q, block_m, block_n) | {
        "UNIT": key_unit(k_cache.shape[1], block_n),
        "CHUNK_TILES": CHUNK_TILES,
        "SPLIT": split,
        "SOFTCAP": call.softcap > 0,
        "HAS_WINDOW": call.window > 0,
        "num_warps": 4,
        "num_stages": 3 if tile_tier(head_dim, q.element_size()) == 0 else 2,
    }
    grid = ((num_seqs // block_q + num_groups + 2) * num_splits * num_kv_heads,)
    launches = [KernelLaunch(_cascade_decode_kernel, grid, args, options)]
    if split:
        launches.append(reduce_splits_launch(part_o, part_lse, out, None))
    return launches


@takes_arguments_of(DecodeCall)
def cascade_decode_attention(*args: Any, **kwargs: Any) -> None:
    """Decode attention with shared prefixes, in one pass; writes `out`.

    q, out: [num_seqs, num_heads, head_dim], one query row per sequence, at position
    seq_lens[s] - 1; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (q's dtype,
    or float8_e4m3fn with k_scale and v_scale, as `paged_attention` takes them). Sequence s
    of meta attends its own keys [kv_start[s], seq_lens[s]) through block_tables[s] (cu_seqlens_q
    is not read) and, when row s lies in group g of groups (group_cu_q[g] <= s <
    group_cu_q[g + 1]), that group's prefix keys [0, group_prefix_lens[g]) through
    group_block_tables[g]; the caller keeps kv_start[s] at or after the prefix, as in the two-pass
    path. max_group_q (the most rows of a group) picks the tile shape only. num_splits (1..16)
    splits each program's key stream; by default it is picked from the SM count. The grid depends
    on host ints only, so the call can be captured in a CUDA graph. softcap and window as
    `paged_attention` takes them: a window masks the prefix keys outside it too.
    """
    for launch in cascade_decode_attention_launches(*args, **kwargs):
        launch.run()


@takes_arguments_of(DecodeCall)
def cascade_decode_attention_ref(*args: Any, **kwargs: Any) -> None:
    """Torch version of `cascade_decode_attention` (same contract), one sequence at a time in fp32:
    softmax attention over [prefix keys ; own keys]."""
    call = DecodeCall(*args, **kwargs)
    num_groups, _, kv_start, _ = _check_args(call, kernel=False)
    q, k_cache, v_cache, meta, groups = call.q, call.k_cache, call.v_cache, call.meta, call.groups
    k_scale, v_scale = call.k_scale, call.v_scale
    cu = groups.group_cu_q.tolist()
    prefix_lens = groups.group_prefix_lens.tolist()
    lens, starts = meta.seq_lens.tolist(), kv_start.tolist()
    queries = fp8_query_values(q) if k_cache.dtype == checks.FP8_KV_DTYPE else q
    for s in range(q.shape[0]):
        k, v = gather_keys(
            k_cache, v_cache, meta.block_tables[s], starts[s], lens[s], k_scale, v_scale
        )
        key_pos = torch.arange(starts[s], lens[s], device=q.device)
        g = next((g for g in range(num_groups) if cu[g] <= s < cu[g + 1]), None)
        if g is not None and prefix_lens[g] > 0:
            table = groups.group_block_tables[g]
            k_p, v_p = gather_keys(k_cache, v_cache, table, 0, prefix_lens[g], k_scale, v_scale)
            k, v = torch.cat([k_p, k]), torch.cat([v_p, v])
            key_pos = torch.cat([torch.arange(prefix_lens[g], device=q.device), key_pos])
        position = torch.tensor([lens[s] - 1], device=q.device)
        allowed = causal_window(position, key_pos, call.window)
        o, _ = attend(queries[s : s + 1], k, v, call.scale, allowed, call.softcap)
        call.out[s] = o[0].to(call.out.dtype)
