"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat batch of tokens: the one
class `registry.py` builds for each of those architectures.

The batch is one flat token list mixing prefill chunks and decode tokens of many sequences; attention reads
and writes the paged KV cache through the step's `ForwardContext`. q/k/v and gate/up are fused into one
matrix each at load time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..parallel.group import TensorParallel
from .arch import ModelArch
from .base import CausalLM
from .fp8_linear import QuantizedRows, takes_quantized_rows
from .linear import RowInvariantLinear
from .ops import ModelOps
from .rotary import rotary_table
from .sharding import Cut, ParamLayout, Piece, kv_head_cut, local_arch
from .vocab_parallel import VocabParallelEmbedding, vocab_logits

if TYPE_CHECKING:
    from ..attention.backend import ForwardContext
    from ..attention.metadata import SampledRows


class RMSNorm(nn.Module):
    """Hugging Face Llama's RMSNorm; with a residual the add is fused in: returns (norm(x + r), x + r).
    With `quantizes_output` the norm comes as QuantizedRows, for the FP8 linear layer after it."""

    def __init__(self, size: int, eps: float, ops: ModelOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops
        self.quantizes_output = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if not self.quantizes_output:
            return self.ops.rms_norm(x, self.weight, self.eps, residual)
        values, scales, summed = self.ops.rms_norm_fp8(x, self.weight, self.eps, residual)
        rows = QuantizedRows(values, scales)
        return rows if summed is None else (rows, summed)


class Attention(nn.Module):
    """One rank's heads (`arch` is the rank's, sharding.local_arch): its share of q/k/v's columns,
    o_proj's matching rows, and an all-reduce of o_proj's partial sums."""

    def __init__(
        self, arch: ModelArch, layer_idx: int, ops: ModelOps, parallel: TensorParallel
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.ops = ops
        self.parallel = parallel
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
        )
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.qkv_proj = RowInvariantLinear(
            arch.hidden_size, arch.q_size + 2 * arch.kv_size, bias=arch.qkv_bias
        )
        self.o_proj = RowInvariantLinear(arch.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, ops) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, ops) if arch.qk_norm else None
        self.scale = arch.head_dim**-0.5
        self.softcap, self.window = (
            0.0,
            0,
        )  # a family's score shaping (Gemma's), as ctx.attend takes

    def forward(
        self,
        x: torch.Tensor | QuantizedRows,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        ctx: ForwardContext,
        rows: SampledRows | None = None,
    ) -> torch.Tensor:
        """Every row's keys and values go to the cache; the output is every row's, or `rows`' only."""
        q = self._project_to_cache(x, positions, cos_sin, ctx)
        meta = None
        if rows is not None:
            q, meta = q[rows.token_rows], rows.metadata
        out = ctx.attend(self.layer_idx, q, self.scale, meta, self.softcap, self.window)
        return self.parallel.all_reduce(self.o_proj(out.view(-1, self.q_size)))

    def norm_queries_and_keys(
        self, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] as attention takes them:
        RMS-normalized per head where the family does it (Qwen3), else as they are."""
        if self.q_norm is not None and self.k_norm is not None:
            return self.q_norm(q), self.k_norm(k)
        return q, k

    def _project_to_cache(
        self,
        x: torch.Tensor | QuantizedRows,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """Rotated queries [tokens, heads, head_dim]; the rotated keys and the values are cached."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.norm_queries_and_keys(q, k)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        return self.ops.rotary_to_cache(q, k, v, positions, cos_sin, k_cache, v_cache, ctx.slots)


class MLP(nn.Module):
    """One rank's columns of gate/up, down_proj's matching rows, an all-reduce of its partial sums."""

    def __init__(self, arch: ModelArch, ops: ModelOps, parallel: TensorParallel) -> None:
        super().__init__()
        self.ops = ops
        self.parallel = parallel
        self.gate_up_proj = RowInvariantLinear(
            arch.hidden_size, 2 * arch.intermediate_size, bias=False
        )
        self.down_proj = RowInvariantLinear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.quantizes_activation = False  # act_and_mul's output as QuantizedRows for down_proj
        # act(gate) * up, and its FP8 form: SwiGLU here, a family's own gate where it differs
        self.act_and_mul, self.act_and_mul_fp8 = ops.silu_and_mul, ops.silu_and_mul_fp8

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.quantizes_activation:
            down = self.down_proj(QuantizedRows(*self.act_and_mul_fp8(gate_up)))
        else:
            down = self.down_proj(self.act_and_mul(gate_up))
        return self.parallel.all_reduce(down)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        layer_idx: int,
        ops: ModelOps,
        parallel: TensorParallel,
        mlp: nn.Module | None = None,
        attention: type[Attention] = Attention,
    ) -> None:
        """`mlp`: the layer's feed-forward block when it is not the dense MLP (a sparse MoE);
        `attention`: the family's attention class."""
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.self_attn = attention(arch, layer_idx, ops, parallel)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.mlp = mlp or MLP(arch, ops, parallel)

    def fuse_fp8_inputs(self) -> None:
        """Where the linear after a norm or the activation takes QuantizedRows, that norm or
        activation writes them: its output is quantized in the pass that computes it, instead of
        being stored in the model's dtype and read again by the linear's own quantization."""
        self.input_layernorm.quantizes_output = takes_quantized_rows(self.self_attn.qkv_proj)
        if isinstance(self.mlp, MLP):  # a sparse MoE block reads its input in the model's dtype
            self.norm_before_mlp().quantizes_output = takes_quantized_rows(self.mlp.gate_up_proj)
            self.mlp.quantizes_activation = takes_quantized_rows(self.mlp.down_proj)

    def norm_before_mlp(self) -> RMSNorm:
        """The norm whose output the MLP reads (a family with other norms overrides)."""
        return self.post_attention_layernorm

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        ctx: ForwardContext,
        rows: SampledRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) of every row, or of `rows` only once their keys and values are cached."""
        # The residual stream is carried beside x so that each add fuses into the next norm.
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin, ctx, rows)
        if rows is not None:
            residual = residual[rows.token_rows]
        return self.mlp_block(x, residual)

    def mlp_block(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's second half, from the attention's output: the norms a family puts around
        its MLP (a family with other norms overrides)."""
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


# A checkpoint's separate projections -> (the fused parameter they fill, their shard of it).
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class LlamaForCausalLM(CausalLM):
    attention: type[Attention] = Attention  # a variant's own attention (OLMoE's q/k norms)

    def build(self, max_positions: int, ops: ModelOps) -> None:
        arch = self.arch
        p, local = self.parallel, local_arch(arch, self.parallel.size)
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, p)
        self.layers = nn.ModuleList(
            self.decoder_layer(local, i, ops) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.lm_head = (
            None
            if arch.tie_word_embeddings
            else RowInvariantLinear(arch.hidden_size, self.embed_tokens.rows, bias=False)
        )
        # [max_positions, head_dim] fp32 = [cos | sin], shared by every layer.
        self.register_buffer(
            "cos_sin",
            rotary_table(
                arch.head_dim,
                max_positions,
                arch.rope_theta,
                arch.rope_scaling,
                max_position_embeddings=arch.max_position_embeddings,
            ),
            persistent=False,
        )
        self.register_family_buffers(arch, max_positions)

    def register_family_buffers(self, arch: ModelArch, max_positions: int) -> None:
        """The constant buffers a family adds to `cos_sin`, registered once the layers are built
        (Llama has none; Gemma its local rotary table and embedding scale)."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden], or
        # [num_sampled, hidden] of ctx.sampled's rows: past the last layer's keys and values, only
        # the rows that produce a token are computed.
        x, residual = self.embed_tokens(input_ids), None
        *body, last = self.layers
        for layer in body:
            x, residual = layer(x, residual, positions, self.cos_sin, ctx)
        x, residual = last(x, residual, positions, self.cos_sin, ctx, ctx.sampled)
        return self.norm(x, residual)[0]

    def decoder_layer(self, local: ModelArch, layer_idx: int, ops: ModelOps) -> nn.Module:
        """Layer `layer_idx` of this rank (`local`: its shapes); a family with its own layer
        overrides."""
        mlp = self.feed_forward(local, layer_idx, ops)
        return DecoderLayer(local, layer_idx, ops, self.parallel, mlp, self.attention)

    def feed_forward(self, local: ModelArch, layer_idx: int, ops: ModelOps) -> nn.Module | None:
        """Layer `layer_idx`'s feed-forward block; None: the dense MLP (a MoE family overrides)."""
        return None

    def fuse_fp8_inputs(self) -> None:
        """Decides once, after quantization, which norms and activations write FP8 rows."""
        for module in self.modules():
            if isinstance(module, DecoderLayer):
                module.fuse_fp8_inputs()

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [rows, vocab]; into `out` when given (the decode graphs' shared buffer)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_logits(hidden, weight, self.arch.vocab_size, self.parallel, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face tensors in, fusing q/k/v and gate/up; every parameter must be filled once."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for hf_name, tensor in weights:
            target = self.map_checkpoint_name(hf_name)
            if target is None:
                continue
            name, shard = target
            if name not in params:
                if name == "lm_head.weight" and self.lm_head is None:
                    continue  # tied checkpoints may still store lm_head
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has no place in {self.arch.architecture}"
                )
            self._copy_shard(params[name], name, shard, tensor)
            filled.add(f"{name}:{shard}")
        expected = {f"{n}:{s}" for n in params for s in self.shards_of(n)}
        missing = sorted(expected - filled)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

    def map_checkpoint_name(self, hf_name: str) -> tuple[str, str] | None:
        """HF name -> (our parameter name, shard of a fused matrix or '')."""
        if "rotary_emb.inv_freq" in hf_name:
            return None
        name = hf_name.removeprefix("model.")
        for part, (fused, shard) in _FUSED.items():
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard
        return name, ""

    def shards_of(self, name: str) -> tuple[str, ...]:
        if ".qkv_proj." in name:
            return ("q", "k", "v")
        if ".gate_up_proj." in name:
            return ("gate", "up")
        return ("",)

    def layout(self, name: str) -> ParamLayout | None:
        """How this rank holds parameter `name` (sharding.py); None: whole on every rank."""
        a, p = self.arch, self.parallel
        columns, rows = Cut(0, p.size, p.rank), Cut(1, p.size, p.rank)
        if ".qkv_proj." in name:
            kv = kv_head_cut(a, p.size, p.rank)
            pieces = (Piece("q", a.q_size, columns), Piece("k", a.kv_size, kv))
            return ParamLayout(0, (*pieces, Piece("v", a.kv_size, kv)))
        if ".gate_up_proj." in name:
            size = a.intermediate_size
            return ParamLayout(0, (Piece("gate", size, columns), Piece("up", size, columns)))
        if ".o_proj." in name:
            return ParamLayout(1, (Piece("", a.q_size, rows),))
        if ".down_proj." in name:
            return ParamLayout(1, (Piece("", a.intermediate_size, rows),))
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return ParamLayout(0, (Piece("", a.vocab_size, columns),))
        return None

    def _copy_shard(self, param: nn.Parameter, name: str, shard: str, tensor: torch.Tensor) -> None:
        """Copies this rank's part of one checkpoint tensor (cut by the loader) into its place."""
        layout, dest = self.layout(name), param.data
        if layout is not None:
            piece = layout.piece(shard)
            if piece.cut.applies_to(tensor.shape, piece.full_len):
                tensor = piece.cut.take(tensor)  # a whole tensor: the loader did not cut it
            length = piece.cut.local_len(piece.full_len)
            dest = dest.narrow(layout.dim, layout.local_offset(shard), length)
        if dest.shape != tensor.shape:
            raise ValueError(
                f"tensor for {name}[{shard or 'all'}] has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
