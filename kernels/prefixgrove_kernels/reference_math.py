"""Plain torch attention math in fp32 that the reference paths (and the CPU backend) build on.

On the CPU a query row's result must not depend on the other rows of its call, nor on how many keys
past its own the call holds (a prefill chunk's later positions, masked): the engine's CPU backend is
these references, and one request must get the same bytes whatever shares its step. CPU matmuls pick
their kernel, and so their summation order, by shape, and reductions sum in an order set by their
length; so on the CPU `attend` runs in fixed shapes: query rows in blocks of QUERY_BLOCK, keys in
tiles of KEY_TILE from the call's first key, each (block, tile, kv head) one batched-matmul entry of
the same shape, and the softmax's sums taken per tile, then accumulated tile after tile in order.
A tile a row may not see adds exact zeros, so the keys past a row's last one change nothing. The
max is exact in any order. On CUDA the whole call is one masked softmax.
"""

from __future__ import annotations

import torch

from prefixgrove_kernels.checks import FP8_KV_DTYPE, FP8_MAX, MIN_SCALE

# Query rows per CPU matmul entry, the last block zero-padded; small, as a decode step attends one
# row per sequence (4 ran the tiny model's CPU steps faster than 8 or 16).
QUERY_BLOCK = 4
KEY_TILE = 128  # keys per CPU tile, counted from the call's first key


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    allowed: torch.Tensor,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention with its log-sum-exp, in fp32.

    q: [n_q, num_heads, head_dim]; k, v: [n_k, num_kv_heads, head_dim]; allowed: [n_q, n_k] bool.
    softcap > 0 caps each score x = q.k * scale as softcap * tanh(x / softcap) (Gemma 2).
    Returns o: [n_q, num_heads, head_dim] and lse: [n_q, num_heads] (natural log); a row with no
    allowed key gets o = 0 and lse = -inf. On the CPU each row's bytes depend only on its query, the
    keys and values up to its last allowed one, and its mask (see the module docstring).
    """
    if q.device.type == "cpu":
        return _attend_row_invariant(q, k, v, scale, allowed, softcap)
    # Elsewhere every row at once, in one pair of einsums.
    n_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # Query heads h*group .. h*group+group-1 share kv head h: no need to repeat K/V.
    qg = q.float().reshape(n_q, num_kv_heads, group, head_dim)
    scores = cap_scores(torch.einsum("qhgd,khd->hgqk", qg, k.float()) * scale, softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [kvh, group, n_q]
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, 0.0).unsqueeze(-1))
    o = torch.einsum("hgqk,khd->qhgd", probs, v.float()).reshape(n_q, num_heads, head_dim)
    return o, lse.permute(2, 0, 1).reshape(n_q, num_heads)


def cap_scores(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Scores soft-capped to (-softcap, softcap) by tanh; as they are for softcap 0."""
    return torch.tanh(scores / softcap) * softcap if softcap else scores


def causal_window(
    positions: torch.Tensor, key_positions: torch.Tensor, window: int = 0
) -> torch.Tensor:
    """[n_q, n_k] bool: the keys each query may see, causally and, for window > 0, only the last
    `window` positions up to its own (position - key < window, as transformers' sliding mask)."""
    allowed = key_positions[None, :] <= positions[:, None]
    if window:
        allowed &= key_positions[None, :] > positions[:, None] - window
    return allowed


def _attend_row_invariant(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    allowed: torch.Tensor,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` in blocks of QUERY_BLOCK query rows, each over the keys in tiles of KEY_TILE: every
    (block, tile, kv head) is one matmul entry of the same shape."""
    n_q, n_k = allowed.shape
    num_heads, head_dim = q.shape[1:]
    kv_heads = k.shape[1]
    group = num_heads // kv_heads
    blocks, tiles = -(-n_q // QUERY_BLOCK), max(1, -(-n_k // KEY_TILE))
    rows = group * QUERY_BLOCK
    # qb: [blocks, 1, kv_heads, group * QUERY_BLOCK, head_dim]
    # kt, vt: [tiles, KEY_TILE, kv_heads, head_dim]
    qb = _pad_rows(q.float(), blocks * QUERY_BLOCK).view(blocks, QUERY_BLOCK, kv_heads, group, -1)
    qb = qb.permute(0, 2, 3, 1, 4).reshape(blocks, 1, kv_heads, rows, head_dim)
    kt = _pad_rows(k.float(), tiles * KEY_TILE).view(tiles, KEY_TILE, kv_heads, head_dim)
    vt = _pad_rows(v.float(), tiles * KEY_TILE).view(tiles, KEY_TILE, kv_heads, head_dim)
    mask = torch.nn.functional.pad(
        allowed, (0, tiles * KEY_TILE - n_k, 0, blocks * QUERY_BLOCK - n_q)
    )
    mask = mask.view(blocks, 1, QUERY_BLOCK, tiles, KEY_TILE).permute(0, 3, 1, 2, 4)
    # scores: [blocks, tiles, kv_heads, group, QUERY_BLOCK, KEY_TILE]
    scores = cap_scores(torch.matmul(qb, kt.permute(0, 2, 3, 1).unsqueeze(0)) * scale, softcap)
    scores = scores.view(blocks, tiles, kv_heads, group, QUERY_BLOCK, KEY_TILE)
    scores = scores.masked_fill(~mask.unsqueeze(2), -torch.inf)
    m = scores.amax(dim=(1, 5), keepdim=True)  # exact in any order
    p = torch.exp(scores - torch.where(torch.isfinite(m), m, 0.0))
    # Sums of a tile have fixed length; across tiles they accumulate in order (cumsum).
    total = p.sum(dim=-1).cumsum(dim=1)[:, -1]  # [blocks, kv_heads, group, QUERY_BLOCK]
    pv = torch.matmul(p.view(blocks, tiles, kv_heads, rows, KEY_TILE), vt.permute(0, 2, 1, 3))
    acc = pv.cumsum(dim=1)[:, -1].view(blocks, kv_heads, group, QUERY_BLOCK, head_dim)
    o = acc / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    lse = m.view(blocks, kv_heads, group, QUERY_BLOCK) + torch.log(total)
    o = o.permute(0, 3, 1, 2, 4).reshape(-1, num_heads, head_dim)[:n_q]
    return o, lse.permute(0, 3, 1, 2).reshape(-1, num_heads)[:n_q]


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with zero rows appended up to `rows` along its first dimension."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def merge_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combines two attention results over disjoint key sets by their log-sum-exps, in fp32.

    o_*: [n, num_heads, head_dim]; lse_*: [n, num_heads]. lse = -inf marks an empty key set.
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, 0.0)
    w_a = torch.exp(lse_a - m)
    w_b = torch.exp(lse_b - m)
    den = w_a + w_b
    safe_den = torch.where(den > 0, den, 1.0)
    o = (w_a.unsqueeze(-1) * o_a.float() + w_b.unsqueeze(-1) * o_b.float()) / safe_den.unsqueeze(-1)
    return o, m + torch.log(den)


def gather_keys(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lo: int,
    hi: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [lo, hi) of one block-table row: each [hi - lo, num_kv_heads, head_dim].

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; table: [max_blocks]. An FP8
    cache's keys and values come back dequantized, in fp32 (`dequantize_kv`).
    """
    blocks = table[: -(-hi // k_cache.shape[1])].long()
    k, v = k_cache[blocks].flatten(0, 1)[lo:hi], v_cache[blocks].flatten(0, 1)[lo:hi]
    if k_scale is not None and v_scale is not None:
        return dequantize_kv(k, k_scale), dequantize_kv(v, v_scale)
    return k, v


def to_e4m3_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) as e4m3: x / scale in fp32 (scale broadcasts: one value, one per row, ...),
    saturated to +-FP8_MAX, rounded to the nearest e4m3 value (ties to even), as the kernels'
    `rotary.to_e4m3` writes it."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def quantize_rows_math(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] -> (e4m3 codes, fp32 scales [..., 1]): each row under its own scale,
    max(amax(|row|) / 448, MIN_SCALE), as every kernel that quantizes rows takes it
    (`fp8_quant.row_scale`)."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return to_e4m3_ref(x, scale), scale


def fp8_query_values(q: torch.Tensor) -> torch.Tensor:
    """q [..., head_dim] as the attention kernels over an FP8 cache take it, in fp32: each row (one
    token's head) in e4m3 under its own scale (`paged_attention.score_queries`)."""
    codes, scale = quantize_rows_math(q)
    return codes.float() * scale


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Keys or values as FP8 cache codes under the cache's one scale."""
    return to_e4m3_ref(x, scale.reshape(()))


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 cache codes back to what they stand for, in fp32: codes * scale."""
    return codes.to(torch.float32) * scale.float().reshape(())
