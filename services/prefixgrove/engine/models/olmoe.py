"""OLMoE (OlmoeForCausalLM): the mixture-of-experts decoder of `moe.py` whose q and k are
RMS-normalized over the whole projection (every head at once), not per head as Qwen3's are.

Under tensor parallelism a rank holds some heads only, so the sum of squares of each row is
all-reduced before the norm (a KV head held by several ranks counted once); the norms' weights are
cut with their heads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ..parallel.group import TensorParallel
from .arch import ModelArch
from .fp8_linear import QuantizedRows
from .llama import Attention
from .moe import MoeForCausalLM
from .ops import ModelOps
from .sharding import Cut, ParamLayout, Piece, kv_head_cut

if TYPE_CHECKING:
    from ..attention.backend import ForwardContext


class ProjectionNorm(nn.Module):
    """RMSNorm over a whole projection of `full_size` columns of which this rank holds `size`;
    `replicas`: how many ranks hold each of its columns (KV heads fewer than ranks)."""

    def __init__(
        self, size: int, full_size: int, eps: float, parallel: TensorParallel, replicas: int
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.full_size, self.eps, self.parallel, self.replicas = full_size, eps, parallel, replicas

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.float()
        squares = self.parallel.all_reduce(rows.pow(2).sum(-1, keepdim=True))
        variance = squares / (self.replicas * self.full_size)
        return self.weight * (rows * torch.rsqrt(variance + self.eps)).to(x.dtype)


class OlmoeAttention(Attention):
    """Llama attention with q and k normalized over the whole projection before the heads split
    (the norms are the model's to build: they need the whole model's sizes)."""

    def _project_to_cache(
        self,
        x: torch.Tensor | QuantizedRows,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        assert self.q_norm is not None and self.k_norm is not None
        q = self.q_norm(q).view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(k).view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        return self.ops.rotary_to_cache(q, k, v, positions, cos_sin, k_cache, v_cache, ctx.slots)


class OlmoeForCausalLM(MoeForCausalLM):
    attention = OlmoeAttention

    def __init__(
        self,
        arch: ModelArch,
        max_positions: int,
        ops: ModelOps,
        parallel: TensorParallel | None = None,
    ) -> None:
        super().__init__(arch, max_positions, ops, parallel)
        p, eps = self.parallel, arch.rms_norm_eps
        replicas = max(1, p.size // arch.num_kv_heads)
        for layer in self.layers:
            attn = cast(OlmoeAttention, layer.self_attn)
            attn.q_norm = ProjectionNorm(attn.q_size, arch.q_size, eps, p, 1)  # type: ignore[assignment]
            attn.k_norm = ProjectionNorm(attn.kv_size, arch.kv_size, eps, p, replicas)  # type: ignore[assignment]

    def layout(self, name: str) -> ParamLayout | None:
        a, p = self.arch, self.parallel
        if name.endswith("self_attn.q_norm.weight"):
            return ParamLayout(0, (Piece("", a.q_size, Cut(0, p.size, p.rank)),))
        if name.endswith("self_attn.k_norm.weight"):
            return ParamLayout(0, (Piece("", a.kv_size, kv_head_cut(a, p.size, p.rank)),))
        return super().layout(name)
