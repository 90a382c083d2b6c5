"""The MLP's gate/up projection with silu(gate) * up fused in its epilogue (kernels/gate_up_silu.py)
against cuBLAS followed by the separate silu_and_mul kernel, on Llama-3.1-8B's shapes in bf16.

For each row count: every tile configuration of the sweep (checked against the unfused result), then
the whole MLP (gate/up, gate, down) both ways in alternating sustained bursts, since a matmul's rate
under a long load (the board at its power limit) is what the engine sees.
Usage: python benchmarks/gate_up_silu.py [--rows 512,16384] [--iters 50] [--bursts 4]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from _common import device_name, emit, ensure_prefixgrove

HIDDEN, INTERMEDIATE = 4096, 14336


def time_us(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    ensure_prefixgrove()
    from prefixgrove.kernels.activation import silu_and_mul
    from prefixgrove.kernels.gate_up_silu import TileConfig, default_tile_config, gate_up_silu

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="512,16384")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--bursts", type=int, default=4)
    ap.add_argument("--sweep", action="store_true", help="time every tile configuration")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    w = torch.randn(2 * INTERMEDIATE, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    w_down = torch.randn(HIDDEN, INTERMEDIATE, device=dev, dtype=torch.bfloat16) * 0.02
    sweep = [
        TileConfig(128, 128, 64, 8, 8, 3),
        TileConfig(128, 128, 64, 8, 8, 4),
        TileConfig(128, 64, 64, 8, 4, 4),
        TileConfig(128, 64, 64, 8, 8, 4),
        TileConfig(128, 64, 64, 8, 4, 3),
        TileConfig(256, 64, 64, 8, 8, 3),
        TileConfig(64, 128, 64, 8, 4, 4),
        TileConfig(64, 64, 64, 8, 4, 4),
        TileConfig(128, 128, 32, 8, 8, 4),
        TileConfig(128, 128, 64, 8, 8, 3, persistent=True),
        TileConfig(128, 128, 64, 8, 8, 4, persistent=True),
        TileConfig(128, 64, 64, 8, 4, 4, persistent=True),
        TileConfig(128, 128, 64, 8, 8, 3, persistent=True, warp_specialize=True),
        TileConfig(128, 64, 64, 8, 4, 4, persistent=True, warp_specialize=True),
        TileConfig(128, 128, 64, 8, 4, 3, persistent=True, warp_specialize=True),
    ]
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16)
        flops = 2 * rows * 2 * INTERMEDIATE * HIDDEN

        def unfused(x: torch.Tensor = x) -> torch.Tensor:
            return silu_and_mul(F.linear(x, w))

        want = unfused()
        base_us = time_us(unfused, args.iters)
        linear_us = time_us(lambda x=x: F.linear(x, w), args.iters)
        emit(
            {
                "bench": "gate_up_silu",
                "rows": rows,
                "variant": "cublas+silu_and_mul",
                "us": round(base_us, 1),
                "cublas_alone_us": round(linear_us, 1),
                "device": device_name(),
            }
        )
        configs = sweep if args.sweep else [default_tile_config(rows)]
        for config in configs:
            try:
                got = gate_up_silu(x, w, config=config)
            except Exception as exc:  # a tile that does not fit this GPU's shared memory
                emit(
                    {
                        "bench": "gate_up_silu",
                        "rows": rows,
                        "config": config,
                        "error": str(exc)[:300],
                    }
                )
                configs = [c for c in configs if c != config]
                continue
            err = (got.float() - want.float()).abs().max().item()
            us = time_us(lambda x=x, c=config: gate_up_silu(x, w, config=c), args.iters)
            emit(
                {
                    "bench": "gate_up_silu",
                    "rows": rows,
                    "variant": "fused",
                    "config": list(config),
                    "us": round(us, 1),
                    "tflops": round(flops / us / 1e6, 1),
                    "speedup": round(base_us / us, 3),
                    "max_abs_err": err,
                }
            )

        if args.sweep:  # the fastest of the sweep goes into the sustained comparison
            fused_config = min(
                configs,
                key=lambda c, x=x: time_us(lambda c=c, x=x: gate_up_silu(x, w, config=c), 20),
            )
        else:
            fused_config = default_tile_config(rows)
        mlps = {
            "unfused": lambda x=x: F.linear(silu_and_mul(F.linear(x, w)), w_down),
            "fused": lambda x=x, c=fused_config: F.linear(gate_up_silu(x, w, config=c), w_down),
        }
        for burst in range(args.bursts):
            for name, mlp in mlps.items():
                emit(
                    {
                        "bench": "mlp_sustained",
                        "rows": rows,
                        "variant": name,
                        "config": list(fused_config),
                        "burst": burst,
                        "us": round(time_us(mlp, 10 * args.iters), 1),
                    }
                )


if __name__ == "__main__":
    main()
