"""FP8 linear layers with block scales: weights in float8_e4m3fn with one float32 scale per 128x128
block, activations quantized per token and per 128-column group at run time. This is the layout
of the FP8 checkpoints DeepSeek-V3 and Qwen3 publish (config.json's `quantization_config` with
`quant_method: fp8` and `weight_block_size: [128, 128]`, each weight's scales stored beside it as
`weight_scale_inv`, [ceil(N / 128), ceil(K / 128)], which multiply the codes), and the
`fp8_block_scales` option of `quantization="fp8"` on unquantized checkpoints.

A layer keeps its scales one per row and group ([N, ceil(K / 128)], each block's scale repeated
over its rows): a fused matrix (q|k|v, gate|up) stacks its parts' blocks as they are, whether or
not a part fills whole blocks of rows (a 64-row k_proj has one block of 64 rows).

On CUDA the product is `fp8_block.block_linear`: torch's blockwise-scaled GEMM (cuBLAS)
where this torch and GPU offer it and the layer's blocks all start on a 128th row, else
`fp8_block.block_scaled_mm` (a Triton GEMM reading a scale per row); on the CPU both sides are
dequantized and multiplied in fp32 through `row_invariant_linear`, so a row's result does not depend
on its batch (its activation scales are its own).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from prefixgrove_kernels.fp8_block import (
    GROUP,
    block_linear,
    dequantize_blocks,
    expand_group_scales,
    groups_of,
    native_block_scales,
    quantize_blocks_ref,
    quantize_groups_ref,
    row_scales,
)
from prefixgrove_kernels.reference_math import to_e4m3_ref

from .fp8_layer import Fp8Layer
from .linear import row_invariant_linear

BLOCK_SIZE = [GROUP, GROUP]  # the one `weight_block_size` the kernels take
SCALE_SUFFIX = ".weight_scale_inv"


class Fp8BlockLinear(Fp8Layer):
    """y = x @ W.T (+ bias) with W in e4m3 under 128x128 block scales, x quantized per token and
    per 128 columns."""

    def held_scales(self, weight_scale: torch.Tensor) -> torch.Tensor:
        scale = row_scales(weight_scale, self.out_features)
        if scale.shape[1] != groups_of(self.in_features):
            raise ValueError(
                f"weight_scale {tuple(weight_scale.shape)} has {scale.shape[1]} column blocks "
                f"for {self.in_features} input features (expected {groups_of(self.in_features)})"
            )
        blocks = native_block_scales(scale, self.in_features)  # None: the Triton GEMM's
        self.register_buffer("block_scales", blocks, persistent=False)
        return scale.contiguous()

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        weight_scale: torch.Tensor | None = None,
        row_splits: list[int] | None = None,
    ) -> Fp8BlockLinear:
        """Quantizes a loaded layer's weight in blocks of 128x128 (load-time quantization), the
        blocks counted from the start of each part in `row_splits` (a fused matrix's q, k, v), or,
        with `weight_scale`, by a checkpoint's own scales: its dequantized weight divided by them
        rounds back to the stored e4m3 values exactly."""
        weight = linear.weight.detach()
        rows, cols = weight.shape
        if weight_scale is not None:
            scale = row_scales(weight_scale.to(weight.device), rows)
            codes = to_e4m3_ref(weight, expand_group_scales(scale, cols))
        else:
            parts = [quantize_blocks_ref(part) for part in weight.split(row_splits or [rows])]
            codes = torch.cat([c for c, _ in parts])
            scale = torch.cat([row_scales(s, c.shape[0]) for c, s in parts])
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(codes, scale, bias, weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] in the model's dtype -> [..., out_features]."""
        rows = x.reshape(-1, self.in_features)
        if rows.is_cuda:
            blocks: torch.Tensor | None = self.block_scales  # type: ignore[assignment]
            out = block_linear(rows, self.weight, self.weight_scale, blocks, self.out_dtype)
        else:
            # Exact emulation: both sides dequantized, multiplied in fp32 in the CPU's row blocks.
            # The weight is dequantized per call, so memory stays at one byte a value.
            codes, scales = quantize_groups_ref(rows)
            values = codes.float() * expand_group_scales(scales, self.in_features)
            weight = dequantize_blocks(self.weight, self.weight_scale)
            out = row_invariant_linear(values, weight).to(self.out_dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def check_block_checkpoint(qc: dict[str, Any]) -> None:
    """ValueError naming what a `quant_method: fp8` config asks that is not 128x128 block scales
    on e4m3 weights with dynamic activations."""
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError(
            "quant_method 'fp8' without weight_block_size (per-tensor FP8) is not supported: "
            f"only weight_block_size {BLOCK_SIZE}, or compressed-tensors FP8"
        )
    if list(block) != BLOCK_SIZE:
        raise ValueError(f"weight_block_size {list(block)} is not supported: only {BLOCK_SIZE}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"activation_scheme {qc.get('activation_scheme')!r} is not supported with block "
            "scales: only 'dynamic' (per token and group at run time)"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 format {qc.get('fmt')!r} is not supported: only e4m3")


def dequantize_block_weight(
    name: str, codes: torch.Tensor, scale_inv: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-scaled checkpoint weight [N, K] and its `weight_scale_inv` [ceil(N / 128),
    ceil(K / 128)] (this rank's slices of both) -> (the weight in float32, its scales per row
    and group [N, ceil(K / 128)])."""
    if scale_inv is None:
        raise ValueError(f"checkpoint tensor {name!r} is float8 with no weight_scale_inv")
    rows, cols = codes.shape
    expected = (groups_of(rows), groups_of(cols))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"{name.removesuffix('.weight')}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)} for "
            f"a weight of {tuple(codes.shape)}: expected {expected}, one per {GROUP}x{GROUP} block"
        )
    scale = row_scales(scale_inv, rows)
    return dequantize_blocks(codes, scale), scale
