"""Plain torch attention math in fp32 that the reference paths (and the CPU backend) build on."""

from __future__ import annotations

import torch


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, allowed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention with its log-sum-exp, in fp32.

    q: [n_q, num_heads, head_dim]; k, v: [n_k, num_kv_heads, head_dim]; allowed: [n_q, n_k] bool.
    Returns o: [n_q, num_heads, head_dim] and lse: [n_q, num_heads] (natural log); a row with no
    allowed key gets o = 0 and lse = -inf.
    """
    n_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # Query heads h*group .. h*group+group-1 share kv head h: no need to repeat K/V.
    qg = q.float().reshape(n_q, num_kv_heads, group, head_dim)
    scores = torch.einsum("qhgd,khd->hgqk", qg, k.float()) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [kvh, group, n_q]
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, 0.0).unsqueeze(-1))
    o = torch.einsum("hgqk,khd->qhgd", probs, v.float()).reshape(n_q, num_heads, head_dim)
    return o, lse.permute(2, 0, 1).reshape(n_q, num_heads)


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
    k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, lo: int, hi: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [lo, hi) of one block-table row: each [hi - lo, num_kv_heads, head_dim].

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; table: [max_blocks].
    """
    blocks = table[: -(-hi // k_cache.shape[1])].long()
    return k_cache[blocks].flatten(0, 1)[lo:hi], v_cache[blocks].flatten(0, 1)[lo:hi]
