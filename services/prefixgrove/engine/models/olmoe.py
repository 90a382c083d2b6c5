"""OLMoE (OlmoeForCausalLM): the mixture-of-experts decoder of `moe.py` whose q and k are
RMS-normalized over the whole projection (every head at once), not per head as Qwen3's are.

Under tensor parallelism a rank holds some heads only, so each row's sum of squares is all-reduced
before the norm; the norms' weights are cut with their heads.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.group import TensorParallel
from .arch import ModelArch
from .llama import Attention
from .moe import MoeForCausalLM
from .ops import ModelOps
from .sharding import Cut, ParamLayout, Piece, kv_head_cut


class ProjectionNorm(nn.Module):
    """RMSNorm over a whole projection [tokens, heads, head_dim] of which this rank holds some
    heads: the rows' sums of squares and their lengths are added over the ranks, so a head held
    by several ranks (KV heads fewer than ranks) counts as often in both and the mean is the
    whole projection's."""

    def __init__(self, size: int, eps: float, parallel: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.parallel = eps, parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.float().flatten(-2)
        squares = self.parallel.all_reduce(rows.pow(2).sum(-1, keepdim=True))
        variance = squares / (rows.shape[-1] * self.parallel.size)
        out = self.weight * (rows * torch.rsqrt(variance + self.eps)).to(x.dtype)
        return out.view(x.shape)


class OlmoeAttention(Attention):
    """Llama attention with q and k RMS-normalized over the whole projection."""

    def __init__(
        self, arch: ModelArch, layer_idx: int, ops: ModelOps, parallel: TensorParallel
    ) -> None:
        super().__init__(arch, layer_idx, ops, parallel)
        self.q_norm = ProjectionNorm(self.q_size, arch.rms_norm_eps, parallel)  # type: ignore[assignment]
        self.k_norm = ProjectionNorm(self.kv_size, arch.rms_norm_eps, parallel)  # type: ignore[assignment]


class OlmoeForCausalLM(MoeForCausalLM):
    attention = OlmoeAttention

    def layout(self, name: str) -> ParamLayout | None:
        a, p = self.arch, self.parallel
        if name.endswith("self_attn.q_norm.weight"):
            return ParamLayout(0, (Piece("", a.q_size, Cut(0, p.size, p.rank)),))
        if name.endswith("self_attn.k_norm.weight"):
            return ParamLayout(0, (Piece("", a.kv_size, kv_head_cut(a, p.size, p.rank)),))
        return super().layout(name)
