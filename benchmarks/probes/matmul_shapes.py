"""How fast cuBLAS runs the model's own matmul shapes (a diagnostic for the mixed- and decode-step profiles).

For Llama-3.1-8B's four projections (fused qkv, o, fused gate/up, down) and the logits, at the row counts
the engine runs (a full 16,384-token mixed step, a 512-request decode step, and a few ragged counts), times
`F.linear` in bf16 with CUDA events and prints TFLOP/s against the 8192^3 ceiling measured the same way,
once per BLAS back end torch offers. Also samples the SM clock while a long burst of matmuls runs, since a
sustained load is slower than a short one when the board reaches its power limit.
Usage: cd benchmarks && python -m probes.matmul_shapes [--rows 512,16384,16100] [--iters 50]
"""

from __future__ import annotations

import argparse
import subprocess
from collections.abc import Callable

import torch
import torch.nn.functional as F

from _common import cuda_ms_per_call, device_name, emit

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 14336, 32, 8, 128, 128256
SHAPES = {  # name: (out features N, in features K)
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
    "logits": (VOCAB, HIDDEN),
}


def parse_args(rows: str) -> tuple[list[int], int]:
    """The matmul probes' flags: the row counts to time (--rows, comma-separated; `rows` unless
    given) and the timed calls of each (--iters)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=rows)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    return [int(r) for r in args.rows.split(",")], args.iters


def time_call(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call of `fn` on the GPU, after three warm-up calls, by CUDA events."""
    for _ in range(3):
        fn()
    return cuda_ms_per_call(fn, iters) / 1e3


def time_linear(x: torch.Tensor, w: torch.Tensor, iters: int) -> float:
    return time_call(lambda: F.linear(x, w), iters)


def sm_clock_mhz() -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return int(float(out.split(",")[0]))
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def _layer(backend: str, rows: int, ceiling: float, iters: int) -> None:
    """Times each of the layer's matmuls at `rows` rows, then their sum (the logits excluded)."""
    dev = torch.device("cuda")
    total_flops, total_s = 0.0, 0.0
    for name, (n, k) in SHAPES.items():
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        s = time_linear(x, w, iters)
        flops = 2 * rows * n * k
        if name != "logits":
            total_flops += flops
            total_s += s
        emit(
            {
                "bench": "matmul_shape",
                "backend": backend,
                "rows": rows,
                "shape": name,
                "us": round(s * 1e6, 1),
                "tflops": round(flops / s / 1e12, 1),
                "of_ceiling": round(flops / s / ceiling, 3),
            }
        )
    emit(
        {
            "bench": "matmul_layer",
            "backend": backend,
            "rows": rows,
            "us": round(total_s * 1e6, 1),
            "tflops": round(total_flops / total_s / 1e12, 1),
        }
    )


def _sustained() -> None:
    """A sustained burst of the layer's matmuls: the clock and rate after the board warms up."""
    torch.backends.cuda.preferred_blas_library("cublas")
    x = torch.randn(16384, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * INTERMEDIATE, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    for second in range(6):
        s = time_linear(x, w, 200)
        emit(
            {
                "bench": "matmul_sustained",
                "after_bursts": second + 1,
                "gate_up_tflops": round(2 * 16384 * w.shape[0] * HIDDEN / s / 1e12, 1),
                "sm_clock_mhz": sm_clock_mhz(),
            }
        )


def main() -> None:
    row_counts, iters = parse_args("512,16384,16100,13000")
    torch.manual_seed(0)
    for backend in ["cublas", "cublaslt"]:
        torch.backends.cuda.preferred_blas_library(backend)
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        ceiling = 2 * 8192**3 / time_linear(a, a, iters)
        emit(
            {
                "bench": "matmul_ceiling",
                "backend": backend,
                "tflops": round(ceiling / 1e12, 1),
                "device": device_name(),
            }
        )
        for rows in row_counts:
            _layer(backend, rows, ceiling, iters)
    _sustained()


if __name__ == "__main__":
    main()
