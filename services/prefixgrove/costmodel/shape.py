"""A decoder's sizes as the cost model counts them: the parameters one token multiplies through,
the bytes a decode step reads, and the bytes of one token's keys and values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a Llama-family decoder (dense or mixture-of-experts)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dense_mlp_params: int  # per layer, the MLP a token always runs (0 for an all-sparse MoE)
    expert_params: int  # per layer, one expert's MLP (0 for a dense model)
    experts: int
    experts_per_token: int

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
        ffn = int(config.intermediate_size)
        expert_ffn = int(getattr(config, "moe_intermediate_size", None) or ffn)
        return cls(
            layers=int(config.num_hidden_layers),
            hidden=hidden,
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            vocab=int(config.vocab_size),
            dense_mlp_params=0 if experts else 3 * hidden * ffn,
            expert_params=3 * hidden * expert_ffn if experts else 0,
            experts=int(experts or 0),
            experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0),
        )

    @property
    def attention_params(self) -> int:
        """Per layer: the q, k, v and output projections."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv)

    @property
    def active_params(self) -> int:
        """The linear-layer parameters one token multiplies through, the vocabulary head left
        out (the engine computes logits only for the rows it samples)."""
        mlp = self.dense_mlp_params + self.experts_per_token * self.expert_params
        return self.layers * (self.attention_params + mlp)

    @property
    def active_expert_params(self) -> int:
        """The expert parameters one token multiplies through (0 for a dense model)."""
        return self.layers * self.experts_per_token * self.expert_params

    def expert_weight_bytes(self, weight_dtype: str) -> int:
        """Every expert's weights, every layer."""
        return self.layers * self.experts * self.expert_params * dtype_bytes(weight_dtype)

    @property
    def stored_params(self) -> int:
        """Every linear parameter a decode step may read (all experts), the head included."""
        mlp = self.dense_mlp_params + self.experts * self.expert_params
        return self.layers * (self.attention_params + mlp) + self.head_params

    @property
    def head_params(self) -> int:
        return self.hidden * self.vocab

    def attention_flops(self, query_key_pairs: float) -> float:
        """FLOPs of q·k and p·v over `query_key_pairs` (query, key) pairs, every layer and head."""
        return 4.0 * self.layers * self.heads * self.head_dim * query_key_pairs

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """One token's keys and values over every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes(kv_dtype)

    def weight_bytes(self, weight_dtype: str) -> int:
        """The linear weights in `weight_dtype` (fp8: one byte a parameter, the head in bf16)."""
        body = self.stored_params - self.head_params
        head_dtype = "bfloat16" if weight_dtype == "fp8" else weight_dtype
        return body * dtype_bytes(weight_dtype) + self.head_params * dtype_bytes(head_dtype)


def dtype_bytes(dtype: str) -> int:
    if dtype not in _BYTES:
        raise ValueError(f"dtype {dtype!r} is not one the cost model knows: {', '.join(_BYTES)}")
    return _BYTES[dtype]
