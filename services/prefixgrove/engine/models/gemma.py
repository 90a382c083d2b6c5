"""Gemma 2 and Gemma 3 text (Gemma2ForCausalLM, Gemma3ForCausalLM): the Llama decoder's projections,
cuts and loading, with Gemma's own layer around them.

What differs from Llama (the facts are `arch.gemma`, `arch.GemmaArch`):
- embeddings scaled by sqrt(hidden_size), in the model's dtype, as transformers does;
- RMSNorm weights stored as (1 + w): Gemma's norm multiplies by 1 + w, so the checkpoint's w plus
  one is loaded into the shared RMSNorm, and random weights' 1.0 is Gemma's own zero init;
- four norms a layer: after attention and before and after the feed-forward block;
- a GeGLU feed-forward block (gelu with the tanh approximation: `ops.gelu_tanh_and_mul`);
- attention scaled by query_pre_attn_scalar ** -0.5, its logits soft-capped (Gemma 2), sliding-window
  layers beside global ones, and Gemma 3's q/k norms and its local layers' own rotary base;
- final logits soft-capped (Gemma 2).

The sliding-window layers read the same paged cache as the global ones and keep every block of a
sequence; the window masks the keys before it (engine/attention/backend.py says why).

NOTE: 1 + w is rounded once to the model's dtype at load; transformers adds it in fp32 at every call,
so in bf16 the two differ by that rounding (in fp32 they are equal).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..parallel.group import TensorParallel
from .arch import GemmaArch, ModelArch
from .llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, RMSNorm
from .ops import ModelOps
from .rotary import rotary_table
from .vocab_parallel import vocab_logits

if TYPE_CHECKING:
    from ..attention.backend import ForwardContext


def gemma_facts(arch: ModelArch) -> GemmaArch:
    if arch.gemma is None:
        raise ValueError(f"{arch.architecture} is not a Gemma architecture")
    return arch.gemma


class GemmaAttention(Attention):
    """Llama's attention with Gemma's scale, soft-cap and this layer's window."""

    def __init__(
        self, arch: ModelArch, layer_idx: int, ops: ModelOps, parallel: TensorParallel
    ) -> None:
        super().__init__(arch, layer_idx, ops, parallel)
        facts = gemma_facts(arch)
        self.scale = facts.query_pre_attn_scalar**-0.5
        self.softcap = facts.attn_softcap
        self.window = facts.layer_windows[layer_idx]


class GemmaMLP(MLP):
    """down(gelu_tanh(gate) * up): the Llama MLP's fused gate/up with Gemma's activation."""

    def __init__(self, arch: ModelArch, ops: ModelOps, parallel: TensorParallel) -> None:
        super().__init__(arch, ops, parallel)
        self.act_and_mul, self.act_and_mul_fp8 = ops.gelu_tanh_and_mul, ops.gelu_tanh_and_mul_fp8


class GemmaDecoderLayer(DecoderLayer):
    """x + post_attention_norm(attention(input_norm(x))), then the same around the MLP with the
    pre- and post-feed-forward norms; Llama's layer with its attention half, its residual carried
    beside x so that each add fuses into the norm after it."""

    def __init__(
        self, arch: ModelArch, layer_idx: int, ops: ModelOps, parallel: TensorParallel
    ) -> None:
        mlp = GemmaMLP(arch, ops, parallel)
        super().__init__(arch, layer_idx, ops, parallel, mlp, GemmaAttention)
        size, eps = arch.hidden_size, arch.rms_norm_eps
        self.pre_feedforward_layernorm = RMSNorm(size, eps, ops)
        self.post_feedforward_layernorm = RMSNorm(size, eps, ops)

    def norm_before_mlp(self) -> RMSNorm:
        """The pre-feed-forward norm: with FP8 layers it writes gate_up_proj's rows, as Llama's
        post-attention norm does (Gemma's post-norms feed no linear layer)."""
        return self.pre_feedforward_layernorm

    def mlp_block(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """post_attention_norm on the attention's output alone, then the residual's add fused
        into the pre-feed-forward norm, and the MLP's output normed before the next layer adds it."""
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    def register_family_buffers(self, arch: ModelArch, max_positions: int) -> None:
        facts = gemma_facts(arch)
        # Gemma 3's local layers rotate by their own base; Gemma 2's share the global table.
        local = self.get_buffer("cos_sin")
        if facts.local_rope_theta is not None:
            local = rotary_table(
                arch.head_dim,
                max_positions,
                facts.local_rope_theta,
                None,
                max_position_embeddings=arch.max_position_embeddings,
            )
        self.register_buffer("local_cos_sin", local, persistent=False)
        # sqrt(hidden_size) rounded to the model's dtype first, as transformers scales by it
        scale = torch.tensor(arch.hidden_size**0.5, dtype=torch.get_default_dtype())
        self.register_buffer("embed_scale", scale, persistent=False)

    def decoder_layer(self, local: ModelArch, layer_idx: int, ops: ModelOps) -> nn.Module:
        return GemmaDecoderLayer(local, layer_idx, ops, self.parallel)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        # As Llama's forward (hidden states of ctx.sampled's rows), the embeddings scaled first.
        x, residual = self.embed_tokens(input_ids) * self.embed_scale, None
        windows = gemma_facts(self.arch).layer_windows
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            cos_sin = self.local_cos_sin if windows[i] else self.cos_sin
            rows = ctx.sampled if i == last else None
            x, residual = layer(x, residual, positions, cos_sin, ctx, rows)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [rows, vocab], soft-capped where the model says (in place: `out` stays the
        decode graphs' buffer)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = vocab_logits(hidden, weight, self.arch.vocab_size, self.parallel, out)
        cap = gemma_facts(self.arch).final_softcap
        if cap:
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Llama's loading, each norm's w taken as the 1 + w it multiplies by (in fp32, then
        rounded once to the parameter's dtype)."""
        super().load_weights(
            (name, tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
            for name, tensor in weights
        )
