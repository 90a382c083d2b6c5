"""FP8 (W8A8) linear layers: float8_e4m3fn weights with one float32 scale per output channel, and
activations quantized per token at run time (each row's amax / 448).

On CUDA the product runs on the FP8 tensor cores through `torch._scaled_mm` with row-wise scales
(scale_a [M, 1], scale_b [1, N], bf16 out, fast accumulation). On the CPU it is emulated exactly: the
same rounding to e4m3, then the product of the dequantized values in float32 through
`row_invariant_linear`, so a row's result still does not depend on its batch (each row's activation
scale is its own).

A layer with per-token scales also takes its input already quantized (`QuantizedRows`): the
RMSNorm or SiLU-and-mul before it then writes e4m3 values and scales in the pass that computes
them, instead of an activation in the model's dtype that the layer would read again to quantize.

Block scales (128x128 weight blocks, activations per token and 128 columns) are
`fp8_block_linear.Fp8BlockLinear`'s; this module reads both kinds of FP8 checkpoint and quantizes
a model into either kind of layer (`quantize_model`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from prefixgrove_kernels.checks import FP8_KV_DTYPE as FP8_DTYPE
from prefixgrove_kernels.fp8_quant import quantize_rows_ref as quantize_per_row
from prefixgrove_kernels.reference_math import to_e4m3_ref

from .fp8_block_linear import (
    SCALE_SUFFIX,
    Fp8BlockLinear,
    check_block_checkpoint,
    dequantize_block_weight,
)
from .fp8_layer import Fp8Layer
from .linear import RowInvariantLinear, row_invariant_linear

if TYPE_CHECKING:
    from .base import CausalLM


@dataclass(frozen=True)
class QuantizedRows:
    """A linear layer's input quantized per token, as `Fp8Linear` would quantize it itself."""

    values: torch.Tensor  # [rows, in_features] e4m3
    scales: torch.Tensor  # [rows, 1] float32: row r stands for values[r] * scales[r]


class Fp8Linear(Fp8Layer):
    """y = x @ W.T (+ bias) with W in e4m3 and per-output-channel scales, x quantized per token."""

    # A checkpoint's static activation scale (one for the layer, set by `from_linear`); None: per
    # token at run time.
    input_scale: float | None = None

    def held_scales(self, weight_scale: torch.Tensor) -> torch.Tensor:
        scale = weight_scale.float().reshape(-1)
        if scale.numel() == 1:  # a per-tensor checkpoint scale, expanded to every channel
            scale = scale.expand(self.out_features).clone()
        if scale.numel() != self.out_features:
            raise ValueError(
                f"weight_scale has {scale.numel()} values for {self.out_features} output channels"
            )
        return scale

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        weight_scale: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
    ) -> Fp8Linear:
        """Quantizes a loaded linear layer's weight per output channel (load-time quantization), or,
        with `weight_scale`, by a checkpoint's own scales: its dequantized weight divided by the
        scales it was stored with rounds back to the stored e4m3 values exactly."""
        weight = linear.weight.detach()
        if weight_scale is None:
            q, scale = quantize_per_row(weight)
        else:
            scale = weight_scale.float().reshape(-1, 1).to(weight.device)
            q = to_e4m3_ref(weight, scale)
        bias = None if linear.bias is None else linear.bias.detach()
        layer = cls(q, scale, bias, weight.dtype)
        if input_scale is not None:
            layer.input_scale = float(input_scale)
        return layer

    def _quantize_input(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.input_scale is None:
            if rows.is_cuda:  # one kernel: the torch version's six passes cost more than FP8 saves
                from prefixgrove_kernels.fp8_quant import quantize_rows

                return quantize_rows(rows)
            return quantize_per_row(rows)
        scale = torch.full((rows.shape[0], 1), self.input_scale, device=rows.device)
        return to_e4m3_ref(rows, scale), scale

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """x: [..., in_features] in the model's dtype, or QuantizedRows where the layer quantizes
        per token (see `takes_quantized_rows`) -> [..., out_features]."""
        if isinstance(x, QuantizedRows):
            if self.input_scale is not None:
                raise ValueError(
                    f"this layer quantizes its input by the checkpoint's input_scale "
                    f"{self.input_scale}, not per token: pass it the unquantized rows"
                )
            out = self._product(x.values, x.scales)
            return out.view(*x.values.shape[:-1], self.out_features)
        q, x_scale = self._quantize_input(x.reshape(-1, x.shape[-1]))
        return self._product(q, x_scale).view(*x.shape[:-1], self.out_features)

    def _product(self, q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """(q * x_scale) @ W.T (+ bias) in out_dtype; q: [rows, in] e4m3, x_scale: [rows, 1]."""
        if q.is_cuda:
            out = torch._scaled_mm(
                q,
                self.weight.t(),
                scale_a=x_scale,
                scale_b=self.weight_scale.view(1, -1),
                out_dtype=torch.bfloat16,
                # Hopper's FP8 accumulation without the periodic promotion to fp32, as vLLM's
                # FP8 kernels run: faster on the large prefill layers (HISTORY.md, "Canonical job in
                # FP8"); the CPU emulation accumulates in fp32
                use_fast_accum=True,
            ).to(self.out_dtype)
            if self.bias is not None:
                out = out + self.bias
        else:
            # Exact emulation: dequantize both sides and multiply in fp32 in the CPU's 16-row blocks.
            # The weight is dequantized per call rather than kept, so memory stays at one byte a value.
            w = self.weight.float() * self.weight_scale.view(-1, 1)
            out = row_invariant_linear(q.float() * x_scale, w).to(self.out_dtype)
            if self.bias is not None:
                out = out + self.bias
        return out


def takes_quantized_rows(layer: nn.Module) -> bool:
    """Whether `layer` takes `QuantizedRows`: an Fp8Linear quantizing per token (one with a
    checkpoint's static input scale quantizes by that scale, itself)."""
    return isinstance(layer, Fp8Linear) and layer.input_scale is None


SUPPORTED = ("fp8",)


def check_quantization(quantization: str | None) -> None:
    """ValueError naming an unsupported quantization method."""
    if quantization is not None and quantization not in SUPPORTED:
        raise ValueError(
            f"quantization={quantization!r} is not supported: pass 'fp8' (W8A8, e4m3) or leave it out"
        )


def checkpoint_quantization(hf_config: Any) -> str | None:
    """'fp8' for an FP8 checkpoint (compressed-tensors, or `quant_method: fp8` with 128x128 block
    scales), None for an unquantized one; ValueError naming any other method or layout."""
    qc = _quantization_config(hf_config)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        check_block_checkpoint(qc)
        return "fp8"
    if method != "compressed-tensors":
        raise ValueError(
            f"checkpoint quantization {method!r} is not supported: only compressed-tensors FP8 "
            "and fp8 with 128x128 block scales"
        )
    for name, group in (qc.get("config_groups") or {}).items():
        for role in ("weights", "input_activations"):
            spec = group.get(role)
            if spec is None:
                continue
            if spec.get("num_bits") != 8 or spec.get("type") != "float":
                raise ValueError(
                    f"compressed-tensors group {name!r} {role}: {spec.get('num_bits')}-bit "
                    f"{spec.get('type')} is not supported (only 8-bit float, e4m3)"
                )
            allowed = ("tensor", "channel") if role == "weights" else ("tensor", "token")
            if spec.get("strategy") not in allowed:
                raise ValueError(
                    f"compressed-tensors group {name!r} {role}: strategy "
                    f"{spec.get('strategy')!r} is not supported (expected {' or '.join(allowed)})"
                )
    return "fp8"


def checkpoint_block_scales(hf_config: Any) -> bool:
    """Whether the checkpoint stores 128x128 block scales (`quant_method: fp8`)."""
    qc = _quantization_config(hf_config)
    return qc is not None and qc.get("quant_method") == "fp8"


def _quantization_config(hf_config: Any) -> dict[str, Any] | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return qc if isinstance(qc, dict) else qc.to_dict()


def dequantize_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    scales: dict[str, torch.Tensor],
    input_scales: dict[str, torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor]]:
    """An FP8 checkpoint's tensors with each e4m3 `weight` dequantized into `dtype`: by its
    `weight_scale` (compressed-tensors) or its block scales `weight_scale_inv`. The scales are kept
    in `scales` / `input_scales` by the weight's name (per output channel, or per row and 128-column
    group), for `quantize_model` to store the same e4m3 values again."""
    tensors = dict(weights)  # the e4m3 weights stay one byte a value until dequantized one by one
    skipped = (".weight_scale", SCALE_SUFFIX, ".input_scale", ".weight_zero_point")
    for name, tensor in tensors.items():
        if name.endswith(skipped):
            continue
        if tensor.dtype != FP8_DTYPE:
            yield name, tensor
            continue
        base = name.removesuffix(".weight")
        if base + ".weight_scale" not in tensors:
            weight, scales[name] = dequantize_block_weight(
                name, tensor, tensors.get(base + SCALE_SUFFIX)
            )
            yield name, weight.to(dtype)
            continue
        scale = _channel_scales(base, tensor, tensors[base + ".weight_scale"])
        scales[name] = scale
        if (static := tensors.get(base + ".input_scale")) is not None:
            input_scales[name] = static.float().reshape(-1).max()
        yield name, (tensor.float() * scale.view(-1, 1)).to(dtype)


def _channel_scales(base: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A compressed-tensors weight_scale (one per tensor or per output channel) per channel."""
    scale = scale.float().reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(weight.shape[0])
    if scale.numel() != weight.shape[0]:
        raise ValueError(
            f"{base}.weight_scale has {scale.numel()} values for {weight.shape[0]} rows "
            f"(compressed-tensors block-wise scales are not supported; {SCALE_SUFFIX} are)"
        )
    return scale.clone()


@torch.no_grad()
def quantize_model(
    net: CausalLM,
    weight_scales: dict[str, torch.Tensor] | None = None,
    input_scales: dict[str, torch.Tensor] | None = None,
    block_scales: bool = False,
) -> None:
    """Replaces every `RowInvariantLinear` inside `net.layers` (Llama's qkv, o, gate_up, down) by an
    `Fp8Linear` (an `Fp8BlockLinear` with `block_scales`), whatever the family, and has every module
    of a layer with a `quantize_fp8` method (a MoE block's stacked experts) quantize itself.

    The embedding and lm_head stay in the model's dtype, as vLLM's fp8 keeps them: the logits set the
    sampled token directly and cost a small share of the step. `weight_scales` / `input_scales` (by
    the model's own parameter name, fused layers' shards concatenated) are a checkpoint's scales.
    Then the norms and activations before layers that take `QuantizedRows` are set to write them.
    """
    weight_scales, input_scales = weight_scales or {}, input_scales or {}
    # NOTE: one layer at a time, so each layer's unquantized weights are freed before the next
    # layer is quantized
    for i, layer in enumerate(net.layers):
        # keys are the model's own parameter names, e.g. layers.0.mlp.down_proj.weight
        for parent_name, parent in list(layer.named_modules(prefix=f"layers.{i}")):
            for name, child in list(parent.named_children()):
                if isinstance(child, RowInvariantLinear):
                    key = f"{parent_name}.{name}.weight"
                    fp8: nn.Module
                    if block_scales:
                        splits = _shard_rows(net, key)
                        fp8 = Fp8BlockLinear.from_linear(child, weight_scales.get(key), splits)
                    else:
                        scale, static = weight_scales.get(key), input_scales.get(key)
                        fp8 = Fp8Linear.from_linear(child, scale, static)
                    setattr(parent, name, fp8)
        # blocks that quantize their own weights (MoE experts), with their stored scales
        for module_name, module in layer.named_modules(prefix=f"layers.{i}"):
            quantize = getattr(module, "quantize_fp8", None)
            if quantize is not None:
                prefix = module_name + "."
                stored = {
                    k.removeprefix(prefix): v
                    for k, v in weight_scales.items()
                    if k.startswith(prefix)
                }
                quantize(stored, block_scales)
    net.fuse_fp8_inputs()


def _shard_rows(net: CausalLM, name: str) -> list[int] | None:
    """The rows of each part of a fused matrix on this rank (q, k, v; gate, up), where block
    scales start their blocks afresh; None for an unfused one."""
    layout = net.layout(name)
    if layout is None or layout.dim != 0 or len(layout.pieces) == 1:
        return None
    return [p.cut.local_len(p.full_len) for p in layout.pieces]
