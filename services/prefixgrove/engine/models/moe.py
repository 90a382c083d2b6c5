"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE (a shared expert behind a sigmoid gate) and
Mixtral. Attention, norms and the rest are the Llama family's; a sparse layer's MLP is `SparseMoe`.

Routing is transformers': softmax over every expert in fp32, the top k, renormalized where the
config says (`norm_topk_prob`; Mixtral always), the weights cast to the model's dtype (Mixtral's
kept in fp32). The experts' weights are stacked, [experts, 2 * width, hidden] (gate | up) and
[experts, hidden, width], so that with the Triton ops one routing kernel and two grouped products
run them all (prefixgrove_kernels.moe_routing, fused_moe); with the torch ops each expert's rows go
through the row-invariant products, so a request's bytes on the CPU do not depend on its batch. Under tensor
parallelism every rank holds every expert's slice of the width (gate/up by rows, down by columns) and
one all-reduce adds the partial sums, the shared expert's included.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace

import torch
from torch import nn

from prefixgrove_kernels.fp8_block import expand_group_scales, quantize_blocks_ref, row_scales
from prefixgrove_kernels.fp8_quant import quantize_rows_ref as quantize_per_row
from prefixgrove_kernels.fused_moe import fused_moe, fused_moe_reference
from prefixgrove_kernels.moe_routing import moe_routing
from prefixgrove_kernels.reference_math import to_e4m3_ref

from ..parallel.group import TensorParallel
from .arch import ModelArch, MoeArch
from .linear import row_invariant_linear
from .llama import MLP, LlamaForCausalLM
from .ops import ModelOps
from .sharding import Cut, ParamLayout, Piece

# checkpoint names of one expert's projections -> (our stacked parameter, shard kind)
_EXPERT = re.compile(r"\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
# transformers 5 keeps a layer's experts stacked in memory: [experts, 2 * width, hidden] (gate | up)
# and [experts, hidden, width]
_STACKED = re.compile(r"\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_KINDS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}  # fmt: skip


def _per_expert(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with stacked experts (transformers 5's in-memory form) as the per-expert
    tensors of the published checkpoints; everything else as it comes."""
    for name, tensor in weights:
        found = _STACKED.search(name)
        if found is None:
            yield name, tensor
            continue
        prefix = name[: found.start()] + found.group(0).split(".experts.")[0] + ".experts"
        for expert, stacked in enumerate(tensor):
            if found.group(1) == "down_proj":
                yield f"{prefix}.{expert}.down_proj.weight", stacked
            else:
                gate, up = stacked.chunk(2, dim=0)
                yield f"{prefix}.{expert}.gate_proj.weight", gate
                yield f"{prefix}.{expert}.up_proj.weight", up


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [tokens, experts] -> (weights [tokens, k] fp32, expert ids [tokens, k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    ops: ModelOps,
) -> torch.Tensor:
    """Each expert's tokens through its SiLU-gated MLP, weighted and summed per token (experts in
    ascending order, as transformers sums them)."""
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        token_rows, slot = torch.where(ids == expert)
        h = ops.silu_and_mul(row_invariant_linear(x[token_rows], gate_up[expert]))
        y = row_invariant_linear(h, down[expert]) * weights[token_rows, slot, None]
        out.index_add_(0, token_rows, y.to(x.dtype))
    return out


class SparseMoe(nn.Module):
    def __init__(
        self, arch: ModelArch, moe: MoeArch, ops: ModelOps, parallel: TensorParallel
    ) -> None:
        super().__init__()
        self.moe, self.ops, self.parallel = moe, ops, parallel
        # transformers keeps Mixtral's routing weights in fp32, the Qwen MoEs' in the model's dtype
        self.weight_dtype = torch.float32 if arch.architecture == "MixtralForCausalLM" else None
        width = moe.intermediate_size // parallel.size
        hidden = arch.hidden_size
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)  # the router, never quantized
        self.experts_gate_up = nn.Parameter(torch.empty(moe.num_experts, 2 * width, hidden))
        self.experts_down = nn.Parameter(torch.empty(moe.num_experts, hidden, width))
        # FP8 experts (quantize_fp8): float32 scales per expert and output channel, [E, rows], or
        # per expert, row and 128-column group for block scales, [E, rows, groups]
        self.experts_gate_up_scale: torch.Tensor | None = None
        self.experts_down_scale: torch.Tensor | None = None
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_intermediate_size:
            # its partial sum joins the experts' in their one all-reduce: no collective of its own
            width = moe.shared_intermediate_size // parallel.size
            self.shared_expert = MLP(replace(arch, intermediate_size=width), ops, TensorParallel())
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    @torch.no_grad()
    def quantize_fp8(
        self, stored: Mapping[str, torch.Tensor] | None = None, block_scales: bool = False
    ) -> None:
        """W8A8 experts (quantization="fp8"): each expert's weights in e4m3 with one scale per
        output channel (amax / 448), as the dense layers' are, or with `block_scales` one per
        128x128 block (kept per row and 128-column group: [E, rows, groups]); activations per row
        (or per row and group) at run time. `stored`: a checkpoint's scales by parameter name
        (experts_gate_up, experts_down), its shards stacked, which give back its e4m3 values."""
        for name in ("experts_gate_up", "experts_down"):
            weight = getattr(self, name).detach()
            experts, rows, columns = weight.shape
            flat = weight.reshape(experts * rows, columns)
            scale = (stored or {}).get(name)
            if scale is not None:  # [E * rows] per channel, or [E * rows, groups] per block
                scale = scale.to(flat.device).float().reshape(experts * rows, -1)
                per_column = expand_group_scales(scale, columns) if block_scales else scale
                codes = to_e4m3_ref(flat, per_column)
            elif block_scales:  # every expert's gate, up (or down) blocked on its own
                parts = [quantize_blocks_ref(p) for p in flat.split(rows // self._row_parts(name))]
                codes = torch.cat([c for c, _ in parts])
                scale = torch.cat([row_scales(s, c.shape[0]) for c, s in parts])
            else:
                codes, scale = quantize_per_row(flat)
            setattr(self, name, nn.Parameter(codes.view(experts, rows, columns), False))
            shape = (experts, rows, -1) if block_scales else (experts, rows)
            setattr(self, f"{name}_scale", scale.reshape(shape).contiguous())

    @staticmethod
    def _row_parts(name: str) -> int:
        """An expert's parts stacked in parameter `name`: gate and up, or down alone."""
        return 2 if name == "experts_gate_up" else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = row_invariant_linear(x, self.gate.weight)
        k, renormalize = self.moe.top_k, self.moe.norm_topk_prob
        experts = (self.experts_gate_up, self.experts_down)
        gate_up_scale, down_scale = self.experts_gate_up_scale, self.experts_down_scale
        if self.ops.name == "triton":  # one routing kernel, two grouped products for every expert
            weights, ids = moe_routing(
                logits, k, renormalize=renormalize, weight_dtype=self.weight_dtype or x.dtype
            )
            out = fused_moe(
                x, *experts, ids, weights, w_gate_up_scale=gate_up_scale, w_down_scale=down_scale
            )
        else:
            weights, ids = route(logits, k, renormalize)
            weights = weights.to(self.weight_dtype or x.dtype)
            if gate_up_scale is not None:  # FP8 experts: the kernels' math in torch
                out = fused_moe_reference(
                    x,
                    *experts,
                    ids,
                    weights,
                    w_gate_up_scale=gate_up_scale,
                    w_down_scale=down_scale,
                )
            else:
                out = experts_reference(x, *experts, ids, weights, self.ops)
        return self._with_shared_expert(x, out)

    def _with_shared_expert(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The experts' sum plus the shared expert's gated output, summed over the ranks."""
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(row_invariant_linear(x, self.shared_expert_gate.weight))
            out = out + gate * self.shared_expert(x)
        return self.parallel.all_reduce(out)


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_per_expert(weights))

    def feed_forward(self, local: ModelArch, layer_idx: int, ops: ModelOps) -> nn.Module | None:
        moe = self.arch.moe
        if moe is None or layer_idx not in moe.sparse_layers:
            return None
        return SparseMoe(self.arch, moe, ops, self.parallel)

    def map_checkpoint_name(self, hf_name: str) -> tuple[str, str] | None:
        found = _EXPERT.search(hf_name)
        if found is None:
            name = hf_name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
            return super().map_checkpoint_name(name)
        expert, kind = int(found.group(1)), _KINDS[found.group(2)]
        stacked = "experts_down" if kind == "down" else "experts_gate_up"
        layer = hf_name[: found.start()].removeprefix("model.")
        return f"{layer}.mlp.{stacked}", f"{kind}:{expert}"

    def shards_of(self, name: str) -> tuple[str, ...]:
        experts = range(self.arch.moe.num_experts) if self.arch.moe else range(0)
        if name.endswith(".experts_gate_up"):
            return tuple(f"{kind}:{e}" for e in experts for kind in ("gate", "up"))
        if name.endswith(".experts_down"):
            return tuple(f"down:{e}" for e in experts)
        return super().shards_of(name)

    def layout(self, name: str) -> ParamLayout | None:
        """Every expert's width cut alike: gate/up by rows (dim 1), down by columns (dim 2); the
        shared expert as a dense MLP of its own width."""
        moe, p = self.arch.moe, self.parallel
        if moe is None:
            return super().layout(name)
        rows, columns = Cut(1, p.size, p.rank), Cut(0, p.size, p.rank)
        if name.endswith(".experts_gate_up"):
            width = moe.intermediate_size
            return ParamLayout(1, (Piece("gate", width, rows), Piece("up", width, rows)))
        if name.endswith(".experts_down"):
            return ParamLayout(2, (Piece("down", moe.intermediate_size, Cut(2, p.size, p.rank)),))
        if ".shared_expert.gate_up_proj." in name:
            width = moe.shared_intermediate_size
            return ParamLayout(0, (Piece("gate", width, columns), Piece("up", width, columns)))
        if ".shared_expert.down_proj." in name:
            return ParamLayout(1, (Piece("", moe.shared_intermediate_size, rows),))
        return super().layout(name)

    def checkpoint_cut(self, hf_name: str) -> tuple[Cut, int] | None:
        found = _EXPERT.search(hf_name)
        if found is None:
            return super().checkpoint_cut(hf_name)
        return self._expert_cut(_KINDS[found.group(2)])

    def _expert_cut(self, kind: str) -> tuple[Cut, int] | None:
        """This rank's cut of one expert's [width, hidden] gate or up (rows) or [hidden, width]
        down (columns), with the width whole; None with one rank."""
        if self.parallel.size == 1 or self.arch.moe is None:
            return None
        dim = 1 if kind == "down" else 0
        return Cut(dim, self.parallel.size, self.parallel.rank), self.arch.moe.intermediate_size

    def _copy_shard(self, param: nn.Parameter, name: str, shard: str, tensor: torch.Tensor) -> None:
        if ":" not in shard:
            return super()._copy_shard(param, name, shard, tensor)
        kind, expert = shard.split(":")
        found = self._expert_cut(kind)
        if found is not None and found[0].applies_to(tensor.shape, found[1]):
            tensor = found[0].take(tensor)  # a whole tensor: the loader did not cut it
        dest = param.data[int(expert)]
        if kind != "down":
            width = dest.shape[0] // 2
            dest = dest.narrow(0, 0 if kind == "gate" else width, width)
        if dest.shape != tensor.shape:
            raise ValueError(
                f"tensor for {name}[{shard}] has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
