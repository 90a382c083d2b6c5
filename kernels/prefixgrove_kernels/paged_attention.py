"""Paged causal attention over a block-table KV cache, for decode and chunked prefill alike.

One program handles BLOCK_Q query tokens of one sequence times the G query heads that share one kv
head, so the M dimension of tl.dot is BLOCK_Q * G even in decode (tensor cores with GQA). Keys come
from the paged cache through the block table in tiles of BLOCK_N, with an online softmax. With a
prefix result (o, lse) given, this is the suffix pass of cascade attention and the merge is fused.

An FP8 cache (float8_e4m3fn, one fp32 scale for the keys and one for the values) is read as e4m3, and
the queries are taken in e4m3 too, each row under its own scale (`score_queries`): with 64 rows or
more in a tile (wgmma's M) q.k runs on the FP8 tensor cores against the bare key codes, which need no
conversion and no round trip through shared memory (benchmarks/RESULTS.md, "Kernels", against the
kernels before in benchmarks/HISTORY.md); with fewer, the same values enter fp16 dots against keys
converted to fp16 (exact). k_scale and the rows' scales multiply the scores (`scores`,
`fold_kv_scales`). The value scale reaches the math one of two ways, each kernel taking the one that
measures faster for it (benchmarks/HISTORY.md, "Decode attention kernels" and "Prefill attention"):
- folded (these kernels and the one-pass decode kernel): the value codes enter p @ v as they are, in
  fp16 (exact: every e4m3 value is an fp16 value; e4m3 -> fp16 is one instruction per pair, -> bf16
  three), and v_scale multiplies the output's normalisation (`finish_rows`).
- per tile (cascade_attention's prefix pass, bound by its dots over a whole group's rows): each value
  tile times its scale in fp32, rounded once to q's dtype (the helpers below take the scale, None
  when folded).
The rest of the math is the same (the FP8 tensor cores accumulate with fewer bits than fp32: the GPU
tolerance of tests/kernels/test_fp8_kv_cache.py). Caches in q's dtype compile to the kernels they
always were.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from prefixgrove_kernels import checks
from prefixgrove_kernels.calls import PagedCall, takes_arguments_of
from prefixgrove_kernels.checks import FP8_MAX, MIN_SCALE
from prefixgrove_kernels.fp8_quant import row_scale
from prefixgrove_kernels.launch import KernelLaunch
from prefixgrove_kernels.merge_states import merge_pair
from prefixgrove_kernels.reference_math import (
    attend,
    causal_window,
    fp8_query_values,
    gather_keys,
    merge_states,
)
from prefixgrove_kernels.rotary import to_e4m3
from prefixgrove_kernels.segments import search_segments

LOG2E = 1.4426950408889634
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def is_suffix_chunk(kv_start, q_len):
    """A grouped sequence (its own keys start after the group's prefix) with more than one query in
    the step: a chunk of its own prompt, which the prefix pass finishes when asked to (decode rows and
    sequences outside every group are the suffix pass's)."""
    return (kv_start > 0) & (q_len > 1)


def is_suffix_chunk_host(kv_start: int, q_len: int) -> bool:
    """`is_suffix_chunk` for the torch references, on host ints."""
    return kv_start > 0 and q_len > 1


@triton.jit
def fold_kv_scales(scale_log2, k_scale_ptr, v_scale_ptr, k_ptr):
    """(the scores' scale, v_scale): for an FP8 cache, scale_log2 times k_scale (the scores are taken
    against the bare key codes) and the cache's v_scale, which `finish_rows` applies (or, in the
    prefix pass, each value tile); otherwise scale_log2 as it is and 1.0 (never used)."""
    v_scale = 1.0
    if k_ptr.dtype.element_ty == tl.float8e4nv:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    return scale_log2, v_scale


@triton.jit
def as_fp16(x):
    """x (fp32) in fp16, saturated at fp16's +-65504 (far past what a model's queries hold)."""
    return tl.clamp(x, -65504.0, 65504.0).to(tl.float16)


@triton.jit
def queries_for_cache(q, k_ptr):
    """q as the dots with this cache's tiles take it: for an FP8 cache, 16-bit queries in fp16 (finer
    than bf16, 10 mantissa bits against 7), so that the codes convert to fp16, the cheap way;
    otherwise q as it is."""
    if k_ptr.dtype.element_ty == tl.float8e4nv:  # noqa: SIM102 (constexprs: the tests compile away)
        if q.dtype != tl.float32:
            q = as_fp16(q.to(tl.float32))
    return q


@triton.jit
def score_queries(q, k_ptr, BLOCK_M: tl.constexpr):
    """(q_dot, q_scale): the queries as the score dots take them. Over an FP8 cache each row is in
    e4m3 under its own scale (amax / 448 in fp32, as `fp8_quant` quantizes a token's activations).
    With 64 rows or more (wgmma's M): the codes, so that q.k runs on the FP8 tensor cores against the
    bare key codes, which then need no conversion and no round trip through shared memory, and the
    rows' scales, which `scores` multiplies in. With fewer: the values the codes stand for (codes
    times scale), in the dtype `queries_for_cache` gives, against keys converted to it, as before
    the queries were quantized (FP8 dots at 16 rows are no faster). Otherwise, and for the values,
    q_scale is 1.0 and never used."""
    q_scale = 1.0
    if k_ptr.dtype.element_ty == tl.float8e4nv:
        rows = q.to(tl.float32)
        scale = row_scale(tl.max(tl.abs(rows), 1), _FP8_MAX, _MIN_SCALE)
        codes = to_e4m3(rows, scale[:, None])
        if BLOCK_M >= 64:
            q_scale = scale
            q = codes
        else:
            values = codes.to(tl.float32) * scale[:, None]
            q = values if q.dtype == tl.float32 else as_fp16(values)
    return q, q_scale


@triton.jit
def tanh(x):
    """tanh in fp32 through one exp2, as sign(x) * (1 - e) / (1 + e) with e = exp(-2|x|): no
    overflow for any x (libdevice's tanh is out of the interpreter's reach)."""
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def softcap_factors(scale_log2, softcap, SOFTCAP: tl.constexpr):
    """(cap_in, cap_out, scale_log2) for `scores`: with SOFTCAP a raw score s becomes
    cap_out * tanh(s * cap_in), softcap * tanh(x / softcap) of the scaled score x already in the
    log2 domain, so the online softmax's own scale turns 1; otherwise nothing changes (the factors
    are never read). scale_log2 is the kernel's, k_scale folded in (fold_kv_scales)."""
    cap_in = 0.0
    cap_out = 0.0
    if SOFTCAP:
        cap_in = scale_log2 / (1.4426950408889634 * softcap)
        cap_out = softcap * 1.4426950408889634
        scale_log2 = 1.0
    return cap_in, cap_out, scale_log2


@triton.jit
def score_scales(scale_log2, softcap, k_scale_ptr, v_scale_ptr, k_ptr, SOFTCAP: tl.constexpr):
    """(scale_log2, v_scale, cap_in, cap_out): the kernel's scale with an FP8 cache's k_scale folded
    in and its v_scale (`fold_kv_scales`), then the soft cap's factors (`softcap_factors`), which
    take the scale over with SOFTCAP."""
    scale_log2, v_scale = fold_kv_scales(scale_log2, k_scale_ptr, v_scale_ptr, k_ptr)
    cap_in, cap_out, scale_log2 = softcap_factors(scale_log2, softcap, SOFTCAP)
    return scale_log2, v_scale, cap_in, cap_out


@triton.jit
def tile_rows(
    q_tile,
    kv_head,
    q_len,
    NUM_QUERIES_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """(q_idx, head, row_valid) of a tile's BLOCK_M rows: with G = NUM_QUERIES_PER_KV, row r is
    query q_idx = q_tile * BLOCK_Q + r // G of its sequence (or segment) of q_len queries, head
    kv_head * G + r % G, valid within the tile's BLOCK_Q queries and q_len."""
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_idx < q_len)
    return q_idx, head, row_valid


@triton.jit
def load_queries(q_ptr, token, head, dims, row_valid, stride_qt, stride_qh):
    """The tile's query rows [BLOCK_M, HEAD_DIM]: row r is head[r] of token[r] (int64), zeros where
    not row_valid."""
    q_offs = token * stride_qt + head * stride_qh
    return tl.load(q_ptr + q_offs[:, None] + dims[None, :], mask=row_valid[:, None], other=0.0)


@triton.jit
def scores(q, q_scale, k, cap_in, cap_out, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """The rows' raw scores q.k over a key tile (k in q's dtype), q and q_scale as `score_queries`
    gives them; soft-capped with SOFTCAP (see softcap_factors). Masks go on after the cap."""
    if q.dtype == tl.float8e4nv:
        s = tl.dot(q, k) * q_scale[:, None]
    else:
        s = tl.dot(q, k, input_precision=DOT_PRECISION)
    if SOFTCAP:
        s = cap_out * tanh(s * cap_in)
    return s


@triton.jit
def finish_rows(acc, l_i, v_scale, k_ptr):
    """(o, has_keys): the rows' output, acc over the softmax sum (times v_scale for an FP8 cache, whose
    values entered p @ v as bare codes; None where the value tiles were scaled), and which rows saw
    any key (0 for those that saw none)."""
    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if k_ptr.dtype.element_ty == tl.float8e4nv:  # noqa: SIM102 (constexprs: the tests compile away)
        if v_scale is not None:
            o = o * v_scale
    return o, has_keys


@triton.jit
def from_cache(x, scale, DTYPE: tl.constexpr):
    """A tile loaded from the cache, in the dots' dtype: an FP8 cache's e4m3 codes converted as they
    are with scale None (exact, or no conversion at all for e4m3 DTYPE; the scales are applied
    outside the tiles, see fold_kv_scales), or times scale in fp32, rounded once to DTYPE (the prefix
    pass's value tiles); a tile of a cache in DTYPE as it is."""
    if x.dtype == tl.float8e4nv:
        if scale is None:  # noqa: SIM108 (a constexpr test: one branch compiles)
            x = x.to(DTYPE)
        else:
            x = (x.to(tl.float32) * scale).to(DTYPE)
    return x


@triton.jit
def online_softmax_step(
    s, scale_log2, v_ptr, v_scale, kv_offs, dims, key_valid, m_i, l_i, acc,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """Folds one key tile into an online softmax (log2 domain). s holds the rows' raw scores q.k
    over the tile; scaling them by scale_log2 rides on the exponent's multiply-add, which saves a
    pass over the tile. MASKED: s is -inf where a key is not allowed and key_valid masks the value
    load; otherwise every key of the tile counts for every row (and key_valid is not read). v_scale:
    an FP8 cache's value scale for each tile, None where it is folded (see from_cache). DTYPE:
    that of the p @ v product's inputs (the queries' own, or fp16 over a folded FP8 cache). Returns the updated (m, l, acc); rows
    with nothing allowed yet keep m = -inf."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    # v: [BLOCK_N, HEAD_DIM]
    v_ptrs = v_ptr + kv_offs[:, None] + dims[None, :]
    if MASKED:
        # NOTE: shift rows whose m is still -inf by 0 to avoid inf - inf.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        v = tl.load(v_ptrs, mask=key_valid[:, None], other=0.0)
    else:
        m_shift = m_new
        v = tl.load(v_ptrs)
    v = from_cache(v, v_scale, DTYPE)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(s * scale_log2 - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def load_keys(k_ptr, kv_offs, dims, key_valid, MASKED: tl.constexpr, DTYPE: tl.constexpr):
    """A key tile as [HEAD_DIM, BLOCK_N] in DTYPE (masked loads read zeros for keys outside
    key_valid); an FP8 cache's codes as they are (k_scale rides on the scores' scale)."""
    k_ptrs = k_ptr + kv_offs[None, :] + dims[:, None]
    k = tl.load(k_ptrs, mask=key_valid[None, :], other=0.0) if MASKED else tl.load(k_ptrs)
    return from_cache(k, None, DTYPE)


@triton.jit
def score_masked_tile(
    q, q_scale, k_ptr, table_row, tile, kv_lo, kv_hi, kv_head, dims, stride_kb, stride_ks, stride_kh,
    cap_in, cap_out, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Key tile `tile` of one block-table row with the keys outside [kv_lo, kv_hi) masked off: the
    rows' raw scores q.k over it, and its keys, their validity and cache offsets (for the online
    softmax step, which loads the values from the same offsets). The block id of each key is loaded
    here, so a loop of these waits for it before each tile's copies: for short or edge loops."""
    keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    key_valid = (keys >= kv_lo) & (keys < kv_hi)
    block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_valid, other=0)
    kv_offs = block.to(tl.int64) * stride_kb + (keys % BLOCK_SIZE) * stride_ks
    kv_offs += kv_head * stride_kh
    k = load_keys(k_ptr, kv_offs, dims, key_valid, True, q.dtype)
    return scores(q, q_scale, k, cap_in, cap_out, DOT_PRECISION, SOFTCAP), keys, key_valid, kv_offs


@triton.jit
def attend_whole_tiles(
    q, q_scale, k_ptr, v_ptr, v_scale, table_row, tile_lo, tile_hi, num_blocks, kv_head, dims,
    scale_log2, m_i, l_i, acc, stride_kb, stride_ks, stride_kh, cap_in, cap_out,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TABLE_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PV_DTYPE: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Folds key tiles [tile_lo, tile_hi) of one block-table row into the online softmax, every key
    of them counting for every row (no masks). The table row (num_blocks entries in use) is read
    TABLE_CHUNK entries at a time into registers and each tile's block ids are gathered from there:
    the key and value copies then depend on no load inside the loop, so the pipeliner keeps
    num_stages - 1 tiles in flight (with the ids loaded from memory in the loop it waits for every
    copy at the top of each iteration: slower on the prefix pass's prefill chunks, see
    benchmarks/HISTORY.md, "Prefill attention")."""
    TILES_PER_CHUNK: tl.constexpr = TABLE_CHUNK * BLOCK_SIZE // BLOCK_N
    entries = tl.arange(0, TABLE_CHUNK)
    for chunk in range(tile_lo // TILES_PER_CHUNK, tl.cdiv(tile_hi, TILES_PER_CHUNK)):
        first_entry = chunk * TABLE_CHUNK
        table = tl.load(
            table_row + first_entry + entries, mask=first_entry + entries < num_blocks, other=0
        )
        chunk_lo = tl.maximum(tile_lo, chunk * TILES_PER_CHUNK)
        chunk_hi = tl.minimum(tile_hi, (chunk + 1) * TILES_PER_CHUNK)
        for tile in range(chunk_lo, chunk_hi):
            keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            # Wrapped into the chunk: the pipeliner computes this for tiles past the loop's end
            # too (their loads are masked off), and a gather index out of range faults on the GPU.
            entry = (keys // BLOCK_SIZE - first_entry) & (TABLE_CHUNK - 1)
            block = tl.gather(table, entry, 0)
            kv_offs = block.to(tl.int64) * stride_kb + (keys % BLOCK_SIZE) * stride_ks
            kv_offs += kv_head * stride_kh
            k = load_keys(k_ptr, kv_offs, dims, keys, False, q.dtype)
            s = scores(q, q_scale, k, cap_in, cap_out, DOT_PRECISION, SOFTCAP)
            m_i, l_i, acc = online_softmax_step(
                s, scale_log2, v_ptr, v_scale, kv_offs, dims, keys, m_i, l_i, acc, False,
                DOT_PRECISION, PV_DTYPE,
            )  # fmt: skip
    return m_i, l_i, acc


# Sequence and tile counts change every step: no specialisation on them (see cascade_attention).
# What a step's shape decides at run time (the grid's mapping, skipping suffix chunks) is an argument, not
# a constexpr: each constexpr combination is a variant, compiled the first time a job meets it.
@triton.jit(do_not_specialize=["num_seqs", "tiles_per_seq", "skip_suffix_chunks"])
def _paged_attention_kernel(
    q_ptr,  # q, out: [num_tokens, num_heads, HEAD_DIM] (token, head strides free)
    k_ptr,  # k_cache, v_cache: [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_ptr,
    k_scale_ptr,  # an FP8 cache's scales: [1] fp32 each (not read for other caches)
    v_scale_ptr,
    out_ptr,
    prefix_o_ptr,  # [num_tokens, num_heads, HEAD_DIM] fp32 or q's dtype
    prefix_lse_ptr,  # [num_tokens, num_heads] fp32
    cu_q_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    kv_start_ptr,  # [num_seqs]
    block_tables_ptr,  # [num_seqs, max_blocks] (row stride stride_bt)
    num_seqs,
    tiles_per_seq,  # query tiles per sequence on the direct grid; 0: tiles are searched for
    skip_suffix_chunks,  # 1: the prefix pass has finished the suffix chunks (see is_suffix_chunk)
    num_heads,
    scale_log2,
    softcap,  # > 0 with SOFTCAP
    window,  # > 0 with HAS_WINDOW: a query at position p sees keys k with p - k < window
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TABLE_CHUNK: tl.constexpr,
    UNMASKED_BODY: tl.constexpr,  # the unmasked loop over the tiles every row sees whole
    HAS_KV_START: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    # Programs are dispatched roughly in program-id order: the grid runs backwards so that the last
    # sequences' last query tiles, the longest of a causal prefill, start first and the short ones
    # fill in behind them. The engine puts a step's grouped rows first and the new prefixes'
    # prompts after them, whose long prefills would otherwise start last and set the launch's tail.
    tile_idx = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    if tiles_per_seq > 0:  # a grid of num_seqs * tiles_per_seq
        seq = tile_idx // tiles_per_seq
        q_tile = tile_idx % tiles_per_seq
    else:
        seq = search_segments(cu_q_ptr, tile_idx, num_seqs, 0, BLOCK_Q, False)
        q_tile = tile_idx - (tl.load(cu_q_ptr + seq) // BLOCK_Q + seq)
    q_begin = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_begin
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    kv_lo = 0
    if HAS_KV_START:
        kv_lo = tl.load(kv_start_ptr + seq)
        if (skip_suffix_chunks != 0) & is_suffix_chunk(kv_lo, q_len):
            return

    scale_log2, v_scale, cap_in, cap_out = score_scales(
        scale_log2, softcap, k_scale_ptr, v_scale_ptr, k_ptr, SOFTCAP
    )

    # Row r of the M dimension is query token r // G of this tile, head kv_head * G + r % G.
    q_idx, head, row_valid = tile_rows(q_tile, kv_head, q_len, NUM_QUERIES_PER_KV, BLOCK_Q, BLOCK_M)
    pos = context + q_idx
    dims = tl.arange(0, HEAD_DIM)
    token = (q_begin + q_idx).to(tl.int64)
    q = load_queries(q_ptr, token, head, dims, row_valid, stride_qt, stride_qh)
    q_dot, q_scale = score_queries(q, k_ptr, BLOCK_M)
    q = queries_for_cache(q, k_ptr)  # for the p @ v dots' dtype

    # The tile's first key: its own keys' first, or, in a window, the first its first row sees.
    keys_lo = kv_lo
    if HAS_WINDOW:
        keys_lo = tl.maximum(kv_lo, context + q_tile * BLOCK_Q - window + 1)
    kv_hi = context + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)  # one past the last key needed
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    t_begin = keys_lo // BLOCK_N
    t_end = tl.cdiv(kv_hi, BLOCK_N)
    full_lo = t_begin
    full_hi = t_begin
    if UNMASKED_BODY:
        # Key tiles [full_lo, full_hi) lie inside [kv_lo, kv_hi) and at or before the tile's first
        # query, so every row may see all their keys: that loop needs no mask (most of a long
        # prefill's tiles). The tiles before and after it (a kv_lo inside a tile, the causal
        # diagonal, the keys some rows' windows leave out) take the masked loop below.
        first_full = kv_lo
        if HAS_WINDOW:  # and inside the tile's last row's window, which starts last
            first_full = tl.maximum(kv_lo, kv_hi - window)
        full_lo = tl.minimum(tl.cdiv(first_full, BLOCK_N), t_end)
        full_hi = tl.maximum(full_lo, (context + q_tile * BLOCK_Q + 1) // BLOCK_N)
        m_i, l_i, acc = attend_whole_tiles(
            q_dot, q_scale, k_ptr, v_ptr, None, table_row, full_lo, full_hi,
            tl.cdiv(kv_hi, BLOCK_SIZE), kv_head, dims, scale_log2, m_i, l_i, acc, stride_kb,
            stride_ks, stride_kh, cap_in, cap_out, BLOCK_SIZE, BLOCK_N, TABLE_CHUNK, DOT_PRECISION,
            q.dtype, SOFTCAP,
        )  # fmt: skip
    # Every tile outside [full_lo, full_hi): all of them without UNMASKED_BODY.
    num_head_tiles = full_lo - t_begin
    for i in range(0, num_head_tiles + t_end - full_hi):
        tile = t_begin + i + tl.where(i < num_head_tiles, 0, full_hi - full_lo)
        s, keys, key_valid, kv_offs = score_masked_tile(
            q_dot, q_scale, k_ptr, table_row, tile, keys_lo, kv_hi, kv_head, dims, stride_kb,
            stride_ks, stride_kh, cap_in, cap_out, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, SOFTCAP,
        )  # fmt: skip
        allowed = key_valid[None, :] & (keys[None, :] <= pos[:, None])
        if HAS_WINDOW:
            allowed &= keys[None, :] > pos[:, None] - window
        s = tl.where(allowed, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(
            s, scale_log2, v_ptr, None, kv_offs, dims, key_valid, m_i, l_i, acc, True,
            DOT_PRECISION, q.dtype,
        )  # fmt: skip

    o, has_keys = finish_rows(acc, l_i, v_scale, k_ptr)
    if HAS_PREFIX:  # noqa: SIM102 (a constexpr: the test compiles away)
        if kv_lo > 0:  # only a grouped sequence has a prefix state (see cascade_attention)
            lse = tl.where(
                has_keys,
                (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) / 1.4426950408889634,
                float("-inf"),
            )
            state_offs = token * num_heads + head  # prefix state is contiguous
            lse_p = tl.load(prefix_lse_ptr + state_offs, mask=row_valid, other=float("-inf"))
            o_offs = state_offs[:, None] * HEAD_DIM + dims[None, :]
            o_p = tl.load(prefix_o_ptr + o_offs, mask=row_valid[:, None], other=0.0)
            o, _ = merge_pair(o_p.to(tl.float32), lse_p, o, lse)
    tl.store(
        out_ptr + (token * stride_ot + head * stride_oh)[:, None] + dims[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise go through tf32 tensor cores (10-bit mantissa).
    return "ieee" if dtype == torch.float32 else "tf32"


def tile_tier(head_dim: int, elem_bytes: int) -> int:
    """0 for rows up to 256 bytes (bf16/fp16 up to head_dim 128), 1 up to 512, 2 beyond: wider
    rows get smaller tiles so that they stay in registers and shared memory."""
    row_bytes = head_dim * elem_bytes
    return 0 if row_bytes <= 256 else 1 if row_bytes <= 512 else 2


def table_chunk(block_size: int, block_n: int) -> int:
    """Block-table entries a program holds in registers at a time (a power of two): 2,048 keys' worth,
    and never less than one key tile (block_size and BLOCK_N are powers of two, so a chunk is a
    whole number of key tiles)."""
    return max(triton.next_power_of_2(max(1, 2048 // block_size)), triton.cdiv(block_n, block_size))


# A launch whose longest query exceeds this holds a long causal prefill (see UNMASKED_BODY below); a
# suffix pass's queries are a request's own tokens, a few hundred.
LONG_QUERY = 512


def _tile_shape(head_dim: int, elem_bytes: int, group: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): 16 rows when all of a sequence's queries fit (decode), more for prefill."""
    tier = tile_tier(head_dim, elem_bytes)
    min_m = max(16, triton.next_power_of_2(group))
    block_m = min_m if max_query_len * group <= min_m else max(min_m, 64 >> tier)
    return block_m, 64 >> tier


def check_paged_attention_args(
    call: PagedCall, kernel: bool = True
) -> tuple[int, int, tuple[torch.Tensor, torch.Tensor]]:
    """Validates everything on the host; returns (num_seqs, GQA ratio, the launch's scale
    arguments: `checks.kv_scale_args`). kernel: as `checks.check_queries`."""
    group, scales = call.check(kernel)
    q, meta = call.q, call.meta
    checks.check_output("out", call.out, q, q.dtype, contiguous=False)
    num_seqs = checks.check_segments(
        q, "cu_seqlens_q", meta.cu_seqlens_q, {"seq_lens": meta.seq_lens, "kv_start": meta.kv_start},
        "block_tables", meta.block_tables, "max_query_len", meta.max_query_len,
    )  # fmt: skip
    checks.check_state(q, "prefix_out", call.prefix_out, "prefix_lse", call.prefix_lse)
    return num_seqs, group, scales


def tile_options(
    q: torch.Tensor, k_cache: torch.Tensor, group: int, block_q: int, block_m: int, block_n: int
) -> dict[str, Any]:
    """The constexprs every attention kernel here shares: the GQA ratio, the row width, the cache
    block and the tile shape (BLOCK_Q queries x G heads = BLOCK_M rows, BLOCK_N keys)."""
    return {
        "NUM_QUERIES_PER_KV": group,
        "HEAD_DIM": q.shape[2],
        "BLOCK_SIZE": k_cache.shape[1],
        "BLOCK_Q": block_q,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "DOT_PRECISION": dot_precision(q.dtype),
    }


def cache_strides(k_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block, slot, kv head) strides of a paged cache (v_cache has k_cache's shape and layout)."""
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


@takes_arguments_of(PagedCall)
def paged_attention_launch(*args: Any, **kwargs: Any) -> KernelLaunch | None:
    """Checks the arguments and plans the launch `paged_attention` makes (None: nothing to do)."""
    call = PagedCall(*args, **kwargs)
    num_seqs, group, scales = check_paged_attention_args(call)
    q, k_cache, out, meta, prefix_out = call.q, call.k_cache, call.out, call.meta, call.prefix_out
    kv_start = meta.kv_start
    if prefix_out is not None and kv_start is None:
        raise ValueError(
            "prefix_out needs kv_start (the state merges into sequences with kv_start > 0)"
        )
    if call.skip_suffix_chunks and kv_start is None:
        raise ValueError("skip_suffix_chunks needs kv_start (suffix chunks are grouped sequences)")
    num_tokens, _, head_dim = q.shape
    if num_tokens == 0 or num_seqs == 0 or meta.max_query_len == 0:
        return None
    block_m, block_n = _tile_shape(head_dim, q.element_size(), group, meta.max_query_len)
    block_q = block_m // group
    tiles_per_seq = triton.cdiv(meta.max_query_len, block_q)
    searched_tiles = num_tokens // block_q + num_seqs
    direct = num_seqs * tiles_per_seq <= searched_tiles
    grid = (num_seqs * tiles_per_seq if direct else searched_tiles, k_cache.shape[2])
    args = (
        q, k_cache, call.v_cache, *scales, out,
        prefix_out if prefix_out is not None else out,
        call.prefix_lse if call.prefix_lse is not None else meta.seq_lens,
        meta.cu_seqlens_q, meta.seq_lens,
        kv_start if kv_start is not None else meta.seq_lens,
        meta.block_tables, num_seqs, tiles_per_seq if direct else 0, int(call.skip_suffix_chunks),
        q.shape[1], call.scale * LOG2E, float(call.softcap), call.window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *cache_strides(k_cache), meta.block_tables.stride(0),
    )  # fmt: skip
    options = tile_options(q, k_cache, group, block_q, block_m, block_n) | {
        "TABLE_CHUNK": table_chunk(k_cache.shape[1], block_n),
        # The suffix pass (kv_start given) streams one request's own keys, a few hundred: there one
        # masked loop beats three loops' pipeline start-ups. But a prefill step's one launch also
        # holds the causal prefills of new prefixes, thousands of keys each, which the unmasked
        # loop takes faster (benchmarks/HISTORY.md, "Prefill attention"): with such a sequence in
        # the launch (a long query), every program takes the three loops.
        "UNMASKED_BODY": kv_start is None or meta.max_query_len > LONG_QUERY,
        "HAS_KV_START": kv_start is not None,
        "HAS_PREFIX": prefix_out is not None,
        "SOFTCAP": call.softcap > 0,
        "HAS_WINDOW": call.window > 0,
        "num_warps": 4,
        "num_stages": 3 if tile_tier(head_dim, q.element_size()) == 0 else 2,
    }
    return KernelLaunch(_paged_attention_kernel, grid, args, options)


@takes_arguments_of(PagedCall)
def paged_attention(*args: Any, **kwargs: Any) -> None:
    """Causal attention of each sequence's new queries over its paged keys; writes `out`.

    q, out: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim], in q's dtype, or float8_e4m3fn with k_scale and v_scale (fp32 tensors
    of one value: a code c stands for c * scale); meta: the step's sequences (index tensors int32). Query i of sequence s
    sits at position seq_lens[s] - q_len_s + i and attends keys [kv_start[s], position].
    prefix_out (fp32 or q's dtype) and prefix_lse (fp32) are merged in by log-sum-exp into the rows
    of sequences with kv_start > 0 (grouped ones, whose own keys start after their group's prefix;
    other rows' state is never read). With skip_suffix_chunks, the rows of suffix chunks (sequences
    with kv_start > 0 and more than one query: see `prefix_attention`'s suffix_chunks) are left as
    they are. softcap > 0 caps each scaled score x as softcap * tanh(x / softcap); window > 0 limits
    a query at position p to keys k with p - k < window (both per layer, compiled in only when set).
    The grid depends on host ints only, so the call can be captured in a CUDA graph.
    """
    launch = paged_attention_launch(*args, **kwargs)
    if launch is not None:
        launch.run()


@takes_arguments_of(PagedCall)
def paged_attention_ref(*args: Any, **kwargs: Any) -> None:
    """Torch version of `paged_attention` (same contract), one sequence at a time in fp32 (an FP8
    cache dequantized: `reference_math.dequantize_kv`)."""
    call = PagedCall(*args, **kwargs)
    num_seqs, _, _ = check_paged_attention_args(call, kernel=False)
    q, k_cache, v_cache, out, meta = call.q, call.k_cache, call.v_cache, call.out, call.meta
    k_scale, v_scale = call.k_scale, call.v_scale
    cu = meta.cu_seqlens_q.tolist()
    lens = meta.seq_lens.tolist()
    starts = meta.kv_start.tolist() if meta.kv_start is not None else [0] * num_seqs
    queries = fp8_query_values(q) if k_cache.dtype == checks.FP8_KV_DTYPE else q
    for s in range(num_seqs):
        q_len = cu[s + 1] - cu[s]
        if q_len == 0 or (call.skip_suffix_chunks and is_suffix_chunk_host(starts[s], q_len)):
            continue
        seq_len, lo = lens[s], starts[s]
        k, v = gather_keys(k_cache, v_cache, meta.block_tables[s], lo, seq_len, k_scale, v_scale)
        positions = torch.arange(seq_len - q_len, seq_len, device=q.device)
        key_pos = torch.arange(lo, seq_len, device=q.device)
        allowed = causal_window(positions, key_pos, call.window)
        rows = slice(cu[s], cu[s + 1])
        o, lse = attend(queries[rows], k, v, call.scale, allowed, call.softcap)
        if call.prefix_out is not None and call.prefix_lse is not None and lo > 0:
            o, _ = merge_states(call.prefix_out[rows].float(), call.prefix_lse[rows], o, lse)
        out[rows] = o.to(out.dtype)
