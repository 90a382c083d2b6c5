"""What every FP8 linear layer holds: its e4m3 weight [out_features, in_features], its scales in
the layer's own layout, an optional bias and the dtype it answers in. `Fp8Linear` (per channel)
and `Fp8BlockLinear` (128x128 blocks) differ in their scales and their product only."""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn

from prefixgrove_kernels.checks import FP8_KV_DTYPE as FP8_DTYPE


class Fp8Layer(nn.Module):
    """The weight checked as e4m3 and held with its scales (`held_scales`), bias and out_dtype."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if weight.dtype != FP8_DTYPE:
            raise ValueError(
                f"{type(self).__name__} takes float8_e4m3fn weights, not {weight.dtype}"
            )
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(self.held_scales(weight_scale), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_dtype = out_dtype

    @abstractmethod
    def held_scales(self, weight_scale: torch.Tensor) -> torch.Tensor:
        """`weight_scale` as given, checked against the weight's shape, in the layout the layer
        keeps; ValueError naming a count that does not fit."""
