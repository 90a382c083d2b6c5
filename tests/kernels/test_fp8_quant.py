"""Per-token FP8 quantization: the kernel writes the e4m3 bytes and scales its torch reference writes."""

from __future__ import annotations

import pytest
import torch

from prefixgrove_kernels.fp8_quant import quantize_rows, quantize_rows_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("rows", "cols"), [(5, 96), (3, 4097), (1, 14336)])
def test_kernel_writes_the_reference_bytes(device, dtype, rows, cols):
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[0, :7] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 448.0, -6e4, 3.5])  # finite in fp16
    if rows > 1:
        x[-1] = 0.0  # an all-zero row keeps a finite scale
    x = x.to(dtype)
    q_ref, scale_ref = quantize_rows_ref(x)
    q, scale = quantize_rows(x.to(device))
    assert torch.equal(scale.cpu(), scale_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    # and it is a quantization: values * scales is x within e4m3's relative step
    back = q_ref.float() * scale_ref
    assert torch.allclose(back, x.float(), rtol=0.0725, atol=float(scale_ref.max()) * 2**-9)


def test_strided_rows_and_no_rows(device):
    x = torch.randn(4, 64, device=device)[:, :40]
    q, scale = quantize_rows(x)
    q_ref, scale_ref = quantize_rows_ref(x.cpu())
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale.cpu(), scale_ref)
    q, scale = quantize_rows(torch.empty(0, 8, device=device))
    assert q.shape == (0, 8) and scale.shape == (0, 1)
