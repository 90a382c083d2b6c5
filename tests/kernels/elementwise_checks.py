"""How the elementwise kernels' tests compare a kernel's output with its torch reference: units in
the last place, the share of elements equal to the bit, and seeded inputs."""

from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.float16]
MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
SMALLEST_SPACING = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}
EPS = 1e-6
NORM_ULPS = {torch.float32: 4, torch.float16: 2}
SILU_ULPS = {torch.float32: 4, torch.float16: 1}


def assert_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int) -> None:
    """Every element of got is within `ulps` units in the last place (of want's dtype) of want."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double().cpu(), want.double().cpu()
    assert torch.equal(g.isnan(), w.isnan())
    _, exponent = torch.frexp(w)
    spacing = torch.ldexp(torch.ones_like(w), exponent - 1 - MANTISSA_BITS[want.dtype])
    spacing = spacing.clamp(min=SMALLEST_SPACING[want.dtype])
    err = ((g - w).abs() / spacing).nan_to_num(0.0)
    assert err.max().item() <= ulps, f"{err.max().item()} ulps apart (allowed {ulps})"


def assert_mostly_equal(got: torch.Tensor, want: torch.Tensor, min_fraction: float = 0.99) -> None:
    """Nearly every element is bit-for-bit the reference's: an ulp tolerance alone would let a
    kernel skip one of the reference's roundings (a quarter of fp16 elements then differ)."""
    equal = (got == want).float().mean().item()
    assert equal >= min_fraction, f"only {equal:.2%} of elements equal the reference"


def randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)
