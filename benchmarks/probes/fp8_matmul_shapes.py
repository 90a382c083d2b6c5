"""How fast the FP8 tensor cores run the model's own matmul shapes, against bf16 (a diagnostic for the FP8
profile of the canonical job).

For Llama-3.1-8B's four projections, at the row counts the engine runs (a full 16,384-token mixed step,
512- and 256-request decode steps), times with CUDA events:
  - bf16 `F.linear`;
  - `torch._scaled_mm` with row-wise scales (Fp8Linear's product), with and without fast accumulation;
  - the same with one per-tensor scale each side (to see whether row-wise scaling costs a slower kernel);
  - the per-token quantization kernel alone (what Fp8Linear adds before each product);
  - block scales (128x128 weight blocks, 1x128 activation groups): the Triton GEMM with a scale
    per weight row, torch's blockwise-scaled GEMM, and the group quantization kernel.
Usage: cd benchmarks && python -m probes.fp8_matmul_shapes [--rows 256,512,16384] [--iters 50]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from probes.matmul_shapes import SHAPES, parse_args, time_call

from prefixgrove_kernels.fp8_block import (
    NATIVE_ROWS,
    block_scaled_mm,
    block_scaled_mm_native,
    quantize_blocks_ref,
    quantize_groups,
    row_scales,
)
from prefixgrove_kernels.fp8_quant import quantize_rows

from _common import device_name, emit

E4M3 = torch.float8_e4m3fn


def variants(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object]]:
    q, x_scale = quantize_rows(x)
    w_q, w_scale = quantize_rows(w)  # per output channel
    w_t, w_row = w_q.t(), w_scale.view(1, -1)
    one = torch.ones((), device=x.device)

    def scaled(fast: bool, rowwise: bool) -> Callable[[], object]:
        a, b = (x_scale, w_row) if rowwise else (one, one)
        return lambda: torch._scaled_mm(
            q, w_t, scale_a=a, scale_b=b, out_dtype=torch.bfloat16, use_fast_accum=fast
        )

    return {
        "bf16": lambda: F.linear(x, w),
        "fp8_rowwise": scaled(False, True),
        "fp8_rowwise_fast_accum": scaled(True, True),
        "fp8_tensorwise": scaled(False, False),
        "fp8_tensorwise_fast_accum": scaled(True, False),
        "quantize_rows": lambda: quantize_rows(x),
        **block_variants(x, w),
    }


def block_variants(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object]]:
    g, g_scale = quantize_groups(x)
    native = quantize_groups(x, NATIVE_ROWS, group_major=True)  # its layout for torch's GEMM
    w_codes, w_blocks = quantize_blocks_ref(w)
    w_rows = row_scales(w_blocks, w.shape[0])  # the layout the Triton GEMM reads
    bf16 = torch.bfloat16
    return {
        "fp8_block_triton": lambda: block_scaled_mm(g, g_scale, w_codes, w_rows, bf16),
        "fp8_block_native": lambda: block_scaled_mm_native(*native, w_codes, w_blocks, bf16),
        "quantize_groups": lambda: quantize_groups(x),
    }


def main() -> None:
    row_counts, iters = parse_args("256,512,16384")
    torch.manual_seed(0)
    dev = torch.device("cuda")
    for rows in row_counts:
        totals: dict[str, float] = {}
        for name, (n, k) in SHAPES.items():
            if name == "logits":
                continue
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            for variant, fn in variants(x, w).items():
                try:
                    s = time_call(fn, iters)
                except RuntimeError as e:  # a scaling mode this torch does not offer
                    emit({"bench": "fp8_matmul", "rows": rows, "shape": name, "variant": variant,
                          "error": str(e).splitlines()[0][:160]})  # fmt: skip
                    continue
                totals[variant] = totals.get(variant, 0.0) + s
                emit({"bench": "fp8_matmul", "rows": rows, "shape": name, "variant": variant,
                      "us": round(s * 1e6, 1), "tflops": round(2 * rows * n * k / s / 1e12, 1)})  # fmt: skip
        emit({"bench": "fp8_matmul_layer", "rows": rows, "device": device_name(),
              "us": {v: round(s * 1e6, 1) for v, s in totals.items()}})  # fmt: skip


if __name__ == "__main__":
    main()
