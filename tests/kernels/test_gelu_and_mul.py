"""gelu_tanh_and_mul (Gemma's GeGLU gate) against torch's gelu(approximate="tanh") * up, fp32 and
fp16, and its FP8 form against quantize_rows of it.

The kernel takes 0.5 * (1 + tanh(u)) as a sigmoid, torch takes tanh: the same function rounded
another way. Where the gate's tail brings gelu near zero, torch's 1 + tanh(u) cancels, so the two
are compared to an absolute tolerance of a few ulps of the gate's size, not the output's.
"""

from __future__ import annotations

import pytest
import torch
from elementwise_checks import randn
from test_fp8_fused import assert_same_bytes, gate_up

from prefixgrove_kernels.activation import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_fp8,
    gelu_tanh_and_mul_ref,
)
from prefixgrove_kernels.fp8_quant import quantize_rows

# the interpreter's exp of the far tail's gates overflows to inf, as the GPU's does: gelu is 0 there
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

# (rtol, atol) for gates ~N(0, 4): a few ulps of the inputs' size
TOLERANCE = {torch.float32: (2e-6, 4e-6), torch.float16: (1e-3, 4e-3)}


def assert_gelu_close(got: torch.Tensor, want: torch.Tensor) -> None:
    rtol, atol = TOLERANCE[want.dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rows", "d"), [(1, 64), (7, 100), (3, 2500)])
def test_gelu_tanh_and_mul_matches_torch(
    dtype: torch.dtype, device: torch.device, rows: int, d: int
) -> None:
    x = randn(rows, 2 * d, dtype=dtype, device=device) * 4
    assert_gelu_close(gelu_tanh_and_mul(x), gelu_tanh_and_mul_ref(x))


def test_gelu_tanh_and_mul_saturates_like_torch_at_extreme_gates(device: torch.device) -> None:
    gate = torch.tensor([-1e4, -100.0, -20.0, -0.0, 0.0, 1e-3, 20.0, 100.0, 1e4])
    x = torch.cat([gate, torch.full_like(gate, 1.5)]).unsqueeze(0).to(device)
    assert_gelu_close(gelu_tanh_and_mul(x), gelu_tanh_and_mul_ref(x))


def test_gelu_tanh_and_mul_fp8_writes_the_bytes_of_quantize_rows_after_it(
    device: torch.device,
) -> None:
    x = gate_up(5, 300, torch.float32, device)
    assert_same_bytes(gelu_tanh_and_mul_fp8(x), quantize_rows(gelu_tanh_and_mul(x)))
