"""rms_norm_fp8 and silu_and_mul_fp8: an FP8 linear layer's input straight out of the norm and the
activation, e4m3 values and one float32 scale per row.

Each writes the bytes of the unfused path, `quantize_rows` of `rms_norm`'s (`silu_and_mul`'s) output,
bit for bit: in Triton's interpreter here, and in bf16 and fp16 on the GPU (the `gpu` tests, and a
CPU test that the GPU compiler sums each row's squares in the unfused kernel's layout). Against the
torch references they are as close as the unfused kernels are to theirs (test_fused_elementwise.py):
a few ulps of the input dtype in a row's scale, and at most one e4m3 step in a value.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from elementwise_checks import MANTISSA_BITS, NORM_ULPS, SILU_ULPS, randn

from prefixgrove_kernels.activation import silu_and_mul, silu_and_mul_fp8, silu_and_mul_fp8_ref
from prefixgrove_kernels.fp8_quant import MIN_SCALE, quantize_rows
from prefixgrove_kernels.rmsnorm import rms_norm, rms_norm_fp8, rms_norm_fp8_ref

DTYPES = [torch.float32, torch.float16]
EPS = 1e-6
E4M3_STEP = 2.0**-3  # e4m3's largest relative spacing (3 mantissa bits)
Quantized = tuple[torch.Tensor, torch.Tensor]


def assert_same_bytes(got: Quantized, want: Quantized) -> None:
    (q, scale), (q_want, scale_want) = got, want
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert q.shape == q_want.shape and scale.shape == scale_want.shape == (q.shape[0], 1)
    assert torch.equal(scale.cpu(), scale_want.cpu())
    assert torch.equal(q.cpu().view(torch.uint8), q_want.cpu().view(torch.uint8))


def assert_near_reference(got: Quantized, want: Quantized, ulps: int, dtype: torch.dtype) -> None:
    """Scales within `ulps` of the input dtype (the row's amax moved by the kernel's rounding), and
    the values they stand for within one e4m3 step."""
    (q, scale), (q_ref, scale_ref) = (t.cpu() for t in got), want
    scale_rtol = ulps * 2.0 ** -MANTISSA_BITS[dtype]
    torch.testing.assert_close(scale, scale_ref, rtol=scale_rtol, atol=0.0)
    back, back_ref = q.float() * scale, q_ref.float() * scale_ref
    atol = float(scale_ref.max()) * 2.0**-9  # e4m3's subnormal spacing
    torch.testing.assert_close(back, back_ref, rtol=E4M3_STEP + 2 * scale_rtol, atol=atol)


def assert_same_sum(got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    """x + residual, returned beside the values: the same, or absent from both."""
    assert (got is None) == (want is None)
    if got is not None and want is not None:
        assert torch.equal(got.cpu(), want.cpu())


def assert_zero_row_kept_finite(q: torch.Tensor, scale: torch.Tensor) -> None:
    """The last row, all zeros, has the smallest scale (not 0, which would divide to NaN)."""
    assert torch.equal(scale[-1].cpu(), torch.tensor([MIN_SCALE], dtype=torch.float32))
    assert not q[-1].float().any()


def unfused_norm(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What the engine did before: rms_norm's output, then quantize_rows reading it again."""
    if residual is None:
        return *quantize_rows(rms_norm(x, weight, EPS)), None
    out, summed = rms_norm(x, weight, EPS, residual=residual)
    return *quantize_rows(out), summed


def norm_inputs(
    rows: int, hidden: int, dtype: torch.dtype, device: torch.device, with_residual: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x with rows of very different sizes, the last one all zero (after the residual add too)."""
    spread = torch.logspace(-2, 2, rows, dtype=torch.float64).unsqueeze(1)
    x = (randn(rows, hidden, dtype=torch.float32, device=torch.device("cpu")) * spread).to(dtype)
    residual = randn(rows, hidden, dtype=dtype, device=device, seed=2) if with_residual else None
    x[-1] = 0.0
    if residual is not None:
        residual[-1] = 0.0
    return x.to(device), randn(hidden, dtype=dtype, device=device, seed=1), residual


# ---- rms_norm_fp8 -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add-norm"])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (7, 100), (33, 128), (5, 1000), (3, 4096)])
def test_rms_norm_fp8_writes_the_bytes_of_quantize_rows_after_rms_norm(
    dtype: torch.dtype, device: torch.device, with_residual: bool, rows: int, hidden: int
) -> None:
    x, weight, residual = norm_inputs(rows, hidden, dtype, device, with_residual)
    q, scale, summed = rms_norm_fp8(x, weight, EPS, residual)
    q_want, scale_want, summed_want = unfused_norm(x, weight, residual)
    assert_same_bytes((q, scale), (q_want, scale_want))
    assert_same_sum(summed, summed_want)
    assert_zero_row_kept_finite(q, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add-norm"])
@pytest.mark.parametrize(("rows", "hidden"), [(7, 100), (33, 128), (3, 4096)])
def test_rms_norm_fp8_is_its_reference_within_the_norms_rounding(
    dtype: torch.dtype, device: torch.device, with_residual: bool, rows: int, hidden: int
) -> None:
    x, weight, residual = norm_inputs(rows, hidden, dtype, torch.device("cpu"), with_residual)
    on_device = residual.to(device) if residual is not None else None
    q, scale, summed = rms_norm_fp8(x.to(device), weight.to(device), EPS, on_device)
    q_ref, scale_ref, summed_ref = rms_norm_fp8_ref(x, weight, EPS, residual)
    assert_near_reference((q, scale), (q_ref, scale_ref), NORM_ULPS[dtype], dtype)
    assert_same_sum(summed, summed_ref)


def test_rms_norm_fp8_reads_strided_rows(device: torch.device) -> None:
    wide = randn(9, 700, dtype=torch.float16, device=device) * 3
    x = wide[:, 100:612]  # row stride 700
    residual = randn(9, 1024, dtype=torch.float16, device=device, seed=2)[:, :512]
    weight = randn(512, dtype=torch.float16, device=device, seed=1)
    q, scale, summed = rms_norm_fp8(x, weight, EPS, residual)
    q_want, scale_want, summed_want = unfused_norm(x.contiguous(), weight, residual.contiguous())
    assert_same_bytes((q, scale), (q_want, scale_want))
    assert_same_sum(summed, summed_want)


def test_rms_norm_fp8_of_no_rows_is_empty(device: torch.device) -> None:
    x = torch.empty(0, 128, device=device)
    q, scale, summed = rms_norm_fp8(x, torch.ones(128, device=device), EPS, torch.empty_like(x))
    assert q.shape == (0, 128) and scale.shape == (0, 1)
    assert summed is not None and summed.shape == (0, 128)


def test_rms_norm_fp8_rejects_bad_arguments_with_the_offending_value(device: torch.device) -> None:
    weight = torch.ones(64, device=device)
    with pytest.raises(ValueError, match=r"takes x as \[rows, hidden\], got \(3, 2, 64\)"):
        rms_norm_fp8(torch.ones(3, 2, 64, device=device), weight, EPS)
    with pytest.raises(ValueError, match=r"takes x as \[rows, hidden\]"):
        rms_norm_fp8_ref(torch.ones(3, 2, 64), weight.cpu(), EPS)
    x = torch.ones(4, 64, device=device)
    with pytest.raises(ValueError, match=r"residual must have shape \(4, 64\), got \(3, 64\)"):
        rms_norm_fp8(x, weight, EPS, torch.ones(3, 64, device=device))
    with pytest.raises(TypeError, match=r"weight has dtype torch\.float16"):
        rms_norm_fp8(x, weight.half(), EPS)


# ---- silu_and_mul_fp8 ---------------------------------------------------------------------------


def gate_up(rows: int, d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[gate | up] with rows of very different sizes, the last one all zero."""
    spread = torch.logspace(-1, 1, rows, dtype=torch.float64).unsqueeze(1)
    x = randn(rows, 2 * d, dtype=torch.float32, device=torch.device("cpu")) * 4 * spread
    x[-1] = 0.0
    return x.to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "d"), [(1, 64), (7, 100), (3, 1024), (5, 2500), (2, 4097)])
def test_silu_and_mul_fp8_writes_the_bytes_of_quantize_rows_after_silu_and_mul(
    dtype: torch.dtype, device: torch.device, rows: int, d: int
) -> None:
    x = gate_up(rows, d, dtype, device)
    fused = silu_and_mul_fp8(x)
    assert_same_bytes(fused, quantize_rows(silu_and_mul(x)))
    assert_zero_row_kept_finite(*fused)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "d"), [(7, 100), (5, 2500)])
def test_silu_and_mul_fp8_is_its_reference_within_silus_rounding(
    dtype: torch.dtype, device: torch.device, rows: int, d: int
) -> None:
    x = gate_up(rows, d, dtype, device)
    assert_near_reference(
        silu_and_mul_fp8(x), silu_and_mul_fp8_ref(x.cpu()), SILU_ULPS[dtype], dtype
    )


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy's exp(1e4)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_fp8_at_extreme_gates(dtype: torch.dtype, device: torch.device) -> None:
    gate = torch.tensor([-1e4, -100.0, -20.0, -0.0, 0.0, 1e-3, 20.0, 100.0], dtype=dtype)
    x = torch.cat([gate, torch.full_like(gate, -3.0)]).view(1, -1).to(device)
    assert_same_bytes(silu_and_mul_fp8(x), quantize_rows(silu_and_mul(x)))


def test_silu_and_mul_fp8_reads_strided_rows_and_no_rows(device: torch.device) -> None:
    x = randn(9, 3000, dtype=torch.float16, device=device)[:, 200:2248]  # row stride 3000
    assert_same_bytes(silu_and_mul_fp8(x), quantize_rows(silu_and_mul(x.contiguous())))
    q, scale = silu_and_mul_fp8(torch.empty(0, 256, device=device))
    assert q.shape == (0, 128) and scale.shape == (0, 1)


def test_silu_and_mul_fp8_rejects_an_odd_width(device: torch.device) -> None:
    with pytest.raises(ValueError, match="odd width 7"):
        silu_and_mul_fp8(torch.ones(2, 7, device=device))


# ---- on the GPU ---------------------------------------------------------------------------------

LOW_PRECISION = [torch.bfloat16, torch.float16]
CUDA = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add-norm"])
@pytest.mark.parametrize("hidden", [4096, 576])  # Llama-3.1-8B, SmolLM2-135M
@pytest.mark.parametrize("tokens", [1, 255, 4097])
def test_gpu_rms_norm_fp8_writes_the_unfused_bytes(
    dtype: torch.dtype, with_residual: bool, hidden: int, tokens: int
) -> None:
    x = randn(tokens, hidden, dtype=dtype, device=CUDA) * 3
    weight = randn(hidden, dtype=dtype, device=CUDA, seed=1)
    residual = randn(tokens, hidden, dtype=dtype, device=CUDA, seed=2) if with_residual else None
    q, scale, summed = rms_norm_fp8(x, weight, EPS, residual)
    q_want, scale_want, summed_want = unfused_norm(x, weight, residual)
    assert_same_bytes((q, scale), (q_want, scale_want))
    assert_same_sum(summed, summed_want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("tokens", [1, 256, 3001])
def test_gpu_silu_and_mul_fp8_writes_the_unfused_bytes(dtype: torch.dtype, tokens: int) -> None:
    x = randn(tokens, 2 * 14336, dtype=dtype, device=CUDA) * 4
    assert_same_bytes(silu_and_mul_fp8(x), quantize_rows(silu_and_mul(x)))


# ---- the GPU compiler's tiles, without a GPU ----------------------------------------------------

# (dtype, hidden, residual): the engine's bf16 and fp16 norms, and the packed rows of small widths.
LAYOUT_CASES = [
    ("bfloat16", 4096, False),
    ("bfloat16", 4096, True),
    ("bfloat16", 576, True),
    ("float16", 5120, True),
    ("float16", 128, False),
    ("float32", 4096, True),
]


def sum_of_squares_layouts(dtype_name: str, hidden: int, with_residual: bool) -> list[str]:
    """The layout the sum of squares is reduced in, compiled for an H100, by rms_norm then by
    rms_norm_fp8: it fixes the order of the additions (run in a process of its own)."""
    from gpu_compile_check import OfflineDriver
    from triton.runtime import driver

    driver.set_active(OfflineDriver(90))  # type: ignore[arg-type]
    dtype = getattr(torch, dtype_name)
    x, weight = torch.empty(300, hidden, dtype=dtype), torch.empty(hidden, dtype=dtype)
    residual = torch.empty_like(x) if with_residual else None
    from prefixgrove_kernels.rmsnorm import rms_norm_fp8_launch, rms_norm_launch

    launches = [
        rms_norm_launch(x, weight, EPS, residual)[0],
        rms_norm_fp8_launch(x, weight, EPS, residual)[0],
    ]
    return [reduced_layout(launch.compile().asm["ttgir"]) for launch in launches if launch]


def reduced_layout(ttgir: str) -> str:
    """The definition of the layout of the first reduction's operand in a TTGIR listing."""
    after = ttgir[ttgir.index('"tt.reduce"') :]
    name = re.search(r"\}\) : \(tensor<[^,]+, (#[\w]+)>\)", after)
    assert name is not None, after[:2000]
    definition = re.search(rf"^{re.escape(name.group(1))} = (.*)$", ttgir, re.MULTILINE)
    assert definition is not None
    return definition.group(1)


def test_rms_norm_fp8_sums_squares_in_the_unfused_kernels_layout_on_the_gpu() -> None:
    """An e4m3 value is one byte: left to itself, the compiler would store 16 of them a thread at
    once where it loads 8 bf16 values of x, and widen the tiles of the whole kernel to match; the
    sums of squares would then add up in another order than the unfused kernel's, and the scales
    and codes differ from its bytes in the last bit."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default, said aloud (no warning)
    done = subprocess.run(
        [sys.executable, __file__, json.dumps(LAYOUT_CASES)],
        env=env,
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    layouts = json.loads(done.stdout.splitlines()[-1])
    for case, (plain, fused) in zip(LAYOUT_CASES, layouts, strict=True):
        assert fused == plain, case


if __name__ == "__main__":  # the compile step of the test above, without TRITON_INTERPRET
    print(json.dumps([sum_of_squares_layouts(*case) for case in json.loads(sys.argv[1])]))
