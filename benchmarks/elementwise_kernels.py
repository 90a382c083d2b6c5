"""Fused elementwise kernels (RMSNorm, residual add + RMSNorm, rotary, SiLU-and-mul) against the
torch chains the Llama model runs without them, at Llama-3.1-8B shapes.

Prints one JSON object: per operation and token count, the median time of each path
(triton.testing.do_bench, microseconds; by default around a CUDA graph of the call, as the engine
runs decode), the bytes the operation must move (read + written once) and the GB/s that makes,
the speedup, and the largest difference between the paths.

    python benchmarks/elementwise_kernels.py                      # 256 and 16384 tokens, bf16
    TRITON_INTERPRET=1 python benchmarks/elementwise_kernels.py --device cpu --dtype float16 \
        --tokens 3 --hidden 256 --heads 4 --kv-heads 2 --head-dim 64 --intermediate 512   # smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any

import torch
import torch.nn.functional as F
import triton

from _common import ensure_prefixgrove, median_us

ensure_prefixgrove()


from prefixgrove.engine.models.rotary import rotary_table  # noqa: E402
from prefixgrove_kernels.activation import silu_and_mul  # noqa: E402
from prefixgrove_kernels.rmsnorm import rms_norm  # noqa: E402
from prefixgrove_kernels.rotary import (  # noqa: E402
    apply_rotary,
    apply_rotary_ref,
    apply_rotary_to_cache,
    apply_rotary_to_cache_ref,
)

EPS = 1e-5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 16384])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--max-positions", type=int, default=131072)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-graph", action="store_true", help="time eager calls, not CUDA graphs")
    return p.parse_args(argv)


# ---- the unfused chains, as services/prefixgrove/engine/models/llama.py runs them ----------


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * x32.to(x.dtype)


def torch_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return torch_rms_norm(s, weight), s


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.split(x.shape[1] // 2, dim=-1)
    return F.silu(gate) * up


# ---- one operation: two paths over the same inputs --------------------------------------------


class Inputs:
    """One operation set's tensors at `tokens` tokens, the same on both paths."""

    def __init__(self, args: argparse.Namespace, tokens: int) -> None:
        dtype, dev = getattr(torch, args.dtype), torch.device(args.device)
        self.size = torch.finfo(dtype).bits // 8
        gen = torch.Generator().manual_seed(0)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype=dtype, device=dev)

        h, d = args.hidden, args.head_dim
        q_size, kv_size = args.heads * d, args.kv_heads * d
        self.x, self.residual, self.weight = rand(tokens, h), rand(tokens, h), rand(h)
        qkv = rand(tokens, q_size + 2 * kv_size)
        self.q = qkv[:, :q_size].view(tokens, args.heads, d)
        self.k = qkv[:, q_size : q_size + kv_size].view(tokens, args.kv_heads, d)
        self.v = qkv[:, q_size + kv_size :].view(tokens, args.kv_heads, d)
        # A paged cache (16-token blocks) with room for 4x the tokens, written at scattered slots.
        self.k_cache = rand(-(-4 * tokens // 16), 16, args.kv_heads, d)
        self.v_cache = torch.empty_like(self.k_cache)
        self.slots = torch.randperm(self.k_cache.shape[0] * 16, generator=gen)[:tokens].to(dev)
        self.cos_sin = rotary_table(d, args.max_positions, 500000.0, None).to(dev)
        self.positions = torch.randint(0, args.max_positions, (tokens,), generator=gen).to(dev)
        self.gate_up = rand(tokens, 2 * args.intermediate)
        self.head_w = rand(d)
        self.qk_elems = tokens * (q_size + kv_size)
        self.qkv_elems = tokens * (q_size + 2 * kv_size)


def _op(name: str, fused: Any, reference: Any, num_bytes: int) -> dict[str, Any]:
    return {"op": name, "fused": fused, "torch": reference, "bytes": num_bytes}


def operations(args: argparse.Namespace, tokens: int) -> list[dict[str, Any]]:
    """Each entry: name, the fused and torch calls (returning tensors), and the bytes moved."""
    t = Inputs(args, tokens)
    h, d, size = args.hidden, args.head_dim, t.size
    x, residual, weight, q, k, head_w = t.x, t.residual, t.weight, t.q, t.k, t.head_w
    rotary_args = (q, k, t.positions, t.cos_sin)
    cache_args = (q, k, t.v, t.positions, t.cos_sin, t.k_cache, t.v_cache, t.slots)
    position_bytes = t.positions.element_size()
    return [
        _op(
            "rms_norm",
            lambda: (rms_norm(x, weight, EPS),),
            lambda: (torch_rms_norm(x, weight),),
            (2 * tokens * h + h) * size,
        ),
        _op(
            "add_rms_norm",
            lambda: rms_norm(x, weight, EPS, residual=residual),
            lambda: torch_add_rms_norm(x, residual, weight),
            (4 * tokens * h + h) * size,
        ),
        _op(
            "qk_head_norm",
            lambda: (rms_norm(q, head_w, EPS), rms_norm(k, head_w, EPS)),
            lambda: (torch_rms_norm(q, head_w), torch_rms_norm(k, head_w)),
            2 * t.qk_elems * size,
        ),
        _op(
            "rotary",
            lambda: apply_rotary(*rotary_args),
            lambda: apply_rotary_ref(*rotary_args),
            2 * t.qk_elems * size + tokens * (d * 4 + position_bytes),
        ),
        # The attention layer's form: rotated keys and the values go to their cache slots.
        _op(
            "rotary_to_cache",
            lambda: (apply_rotary_to_cache(*cache_args),),
            lambda: (apply_rotary_to_cache_ref(*cache_args),),
            2 * t.qkv_elems * size + tokens * (d * 4 + 2 * position_bytes),
        ),
        _op(
            "silu_and_mul",
            lambda: (silu_and_mul(t.gate_up),),
            lambda: (torch_silu_and_mul(t.gate_up),),
            3 * tokens * args.intermediate * size,
        ),
    ]


def max_difference(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))


def measure(args: argparse.Namespace, tokens: int) -> list[dict[str, Any]]:
    results = []
    for op in operations(args, tokens):
        diff = max_difference(op["fused"](), op["torch"]())
        use_graph = not args.no_graph
        fused_us = median_us(op["fused"], args.device, use_graph)
        torch_us = median_us(op["torch"], args.device, use_graph)
        results.append(
            {
                "op": op["op"],
                "tokens": tokens,
                "mb": round(op["bytes"] / 1e6, 3),
                "fused_us": round(fused_us, 2),
                "torch_us": round(torch_us, 2),
                "fused_gb_s": round(op["bytes"] / fused_us / 1e3, 1),
                "torch_gb_s": round(op["bytes"] / torch_us / 1e3, 1),
                "speedup": round(torch_us / fused_us, 2),
                "max_abs_diff": diff,
            }
        )
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU, or pass --device cpu with TRITON_INTERPRET=1")
    report = {
        "benchmark": "elementwise_kernels",
        "device": torch.cuda.get_device_name() if args.device != "cpu" else platform.processor(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "cuda_graph": args.device != "cpu" and not args.no_graph,
        "shape": {
            k: getattr(args, k) for k in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")
        },
        "results": [r for tokens in args.tokens for r in measure(args, tokens)],
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
