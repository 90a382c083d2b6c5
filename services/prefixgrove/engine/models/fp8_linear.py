"""FP8 (W8A8) linear layers: float8_e4m3fn weights with one float32 scale per output channel, and
activations quantized per token at run time (each row's amax / 448).

On CUDA the product runs on the FP8 tensor cores through `torch._scaled_mm` with row-wise scales
(scale_a [M, 1], scale_b [1, N], bf16 out). On the CPU it is emulated exactly: the same rounding to
e4m3, then the product of the dequantized values in float32 through `row_invariant_linear`, so a row's
result still does not depend on its batch (each row's activation scale is its own).
"""

from __future__ import annotations

import torch
from torch import nn

from .linear import RowInvariantLinear, row_invariant_linear

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# A zero row (the CPU path's padding, or a real all-zero activation) keeps a finite scale.
_MIN_SCALE = 1e-12


def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (e4m3 values [R, C], float32 scales [R, 1]) with x ~= values * scales."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


class Fp8Linear(nn.Module):
    """y = x @ W.T (+ bias) with W in e4m3 and per-output-channel scales, x quantized per token."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"Fp8Linear takes float8_e4m3fn weights, not {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        scale = weight_scale.float().reshape(-1)
        if scale.numel() == 1:  # a per-tensor checkpoint scale, expanded to every channel
            scale = scale.expand(self.out_features).clone()
        if scale.numel() != self.out_features:
            raise ValueError(
                f"weight_scale has {scale.numel()} values for {self.out_features} output channels"
            )
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_dtype = out_dtype

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """Quantizes a loaded linear layer's weight per output channel (load-time quantization)."""
        q, scale = quantize_per_row(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(q, scale, bias, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        q, x_scale = quantize_per_row(rows)
        if x.device.type == "cuda":
            out = torch._scaled_mm(
                q,
                self.weight.t(),
                scale_a=x_scale,
                scale_b=self.weight_scale.view(1, -1),
                out_dtype=torch.bfloat16,
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
        return out.view(*x.shape[:-1], self.out_features)


SUPPORTED = ("fp8",)


def check_quantization(quantization: str | None) -> None:
    """ValueError naming an unsupported quantization method."""
    if quantization is not None and quantization not in SUPPORTED:
        raise ValueError(
            f"quantization={quantization!r} is not supported: pass 'fp8' (W8A8, e4m3) or leave it out"
        )


@torch.no_grad()
def quantize_model(net: nn.Module) -> None:
    """Replaces every decoder-layer `RowInvariantLinear` (qkv, o, gate_up, down) by an `Fp8Linear`.

    The embedding and lm_head stay in the model's dtype, as vLLM's fp8 keeps them: the logits set the
    sampled token directly and cost a small share of the step.
    """
    layers = getattr(net, "layers", None)
    if layers is None:
        raise ValueError("quantize_model expects a model with decoder `layers`")
    for layer in layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, RowInvariantLinear):
                    setattr(parent, name, Fp8Linear.from_linear(child))
