"""The fused mixture-of-experts kernels on one GPU, and a mixture-of-experts model's canonical job.

  roofline   fused_moe (routing, alignment, both grouped GEMMs, the weighted sum) on one layer of
             --model's experts at each --tokens count, routed by random router logits: its time
             against the memory roofline (the distinct experts' weights read once, plus the
             activations, at the HBM bandwidth a plain copy reaches on this GPU) and against the
             compute roofline (2 * tokens * top_k * 3 * width * hidden FLOPs at the peak a plain
             bf16 matmul reaches here). Decode sizes are bound by the first, prefill sizes by the
             second; each line gives both shares.
  tune       every tile of a grid at each --tokens count, for moe_configs.TUNED_TILES: one JSON line
             per count with the best tile and its gain over the table's current tile, then one line
             holding the table entry to paste.
  canonical  the canonical job (batchllm.py's group-cascade mode) on --model three ways, side by
             side in this one process: the fused kernels (the engine as it ships), the same in eager
             mode, and the experts run as a per-expert loop of torch matmuls (transformers' way;
             eager, since its shapes depend on the routing); the ratios of the first two to the
             loop's figure.
Prints one JSON line per measurement. Usage:
  python benchmarks/moe.py roofline [--model qwen3-30b-a3b-random] [--tokens 64,256,512,4096]
  python benchmarks/moe.py tune [--tokens 1,16,64,128,256,512,1024,4096]
  python benchmarks/moe.py canonical [--groups 32]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
from typing import Any

import torch

from _common import (
    add_canonical_args,
    device_name,
    emit,
    ensure_prefixgrove,
    median_us_clean_l2,
    shared_prefix_prompts,
)


def _layer(args: argparse.Namespace) -> dict[str, Any]:
    """One sparse layer of --model's shape on the GPU: bf16 experts, its routing settings."""
    from prefixgrove.catalog.presets import load_hf_config
    from prefixgrove.engine.models.arch import ModelArch

    arch = ModelArch.from_hf_config(load_hf_config(args.model))
    moe = arch.moe
    if moe is None:
        raise SystemExit(f"{args.model} has no mixture-of-experts layers")
    gen = torch.Generator(device="cuda").manual_seed(0)
    e, n, k = moe.num_experts, moe.intermediate_size, arch.hidden_size
    w_gate_up = torch.randn(e, 2 * n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w_down = torch.randn(e, k, n, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    return {"moe": moe, "w_gate_up": w_gate_up, "w_down": w_down, "hidden": k, "width": n}


def _routed(layer: dict[str, Any], tokens: int) -> tuple[torch.Tensor, ...]:
    from prefixgrove_kernels.moe_routing import moe_routing

    moe = layer["moe"]
    x = torch.randn(tokens, layer["hidden"], device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, moe.num_experts, device="cuda", dtype=torch.bfloat16)
    weights, ids = moe_routing(
        logits, moe.top_k, renormalize=moe.norm_topk_prob, weight_dtype=torch.bfloat16
    )
    return x, logits, weights, ids


def _copy_bytes_per_s() -> float:
    """The HBM bandwidth a plain device-to-device copy of 2 GiB reaches (read + write)."""
    src = torch.empty(2**30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    us = median_us_clean_l2(lambda: dst.copy_(src), "cuda", use_graph=False, reps=20)
    return 2 * src.numel() * 2 / (us * 1e-6)


def _matmul_flops_per_s() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = median_us_clean_l2(lambda: a @ b, "cuda", use_graph=False, reps=20)
    return 2 * 8192**3 / (us * 1e-6)


def roofline(args: argparse.Namespace) -> None:
    from prefixgrove_kernels.fused_moe import fused_moe
    from prefixgrove_kernels.moe_routing import moe_routing

    layer = _layer(args)
    moe, w_gate_up, w_down = layer["moe"], layer["w_gate_up"], layer["w_down"]
    bandwidth, peak = _copy_bytes_per_s(), _matmul_flops_per_s()
    expert_bytes = (w_gate_up[0].numel() + w_down[0].numel()) * 2
    for tokens in args.tokens:
        x, logits, _, ids = _routed(layer, tokens)

        def step(x: torch.Tensor = x, logits: torch.Tensor = logits) -> torch.Tensor:
            weights, ids = moe_routing(
                logits, moe.top_k, renormalize=moe.norm_topk_prob, weight_dtype=x.dtype
            )
            return fused_moe(x, w_gate_up, w_down, ids, weights)

        us = median_us_clean_l2(step, "cuda", use_graph=True)
        touched = int(torch.unique(ids).numel())
        # weights of the experts routed to, read once; x in, the out rows, h and y's round trips
        pairs = tokens * moe.top_k
        act_bytes = 2 * (2 * tokens * layer["hidden"] + pairs * (3 * layer["width"] + 2 * layer["hidden"]))  # fmt: skip
        moved = touched * expert_bytes + act_bytes
        flops = 2 * pairs * 3 * layer["width"] * layer["hidden"]
        emit({
            "bench": "moe.roofline", "device": device_name(), "model": args.model,
            "tokens": tokens, "experts_touched": touched, "us": round(us, 1),
            "bytes_moved": moved, "achieved_gb_per_s": round(moved / us / 1e3, 1),
            "copy_gb_per_s": round(bandwidth / 1e9, 1),
            "memory_roofline_share": round(moved / bandwidth / (us * 1e-6), 3),
            "achieved_tflops": round(flops / us / 1e6, 1),
            "matmul_tflops": round(peak / 1e12, 1),
            "compute_roofline_share": round(flops / peak / (us * 1e-6), 3),
        })  # fmt: skip


def _tile_grid(tokens: int, layer: dict[str, Any]) -> list[Any]:
    """The tiles tried at `tokens` tokens: row blocks up to four times the pairs an expert gets on
    average (larger ones only pad), every column and reduction tile, 4 or 8 warps, 3 or 4 stages."""
    from prefixgrove_kernels.moe_configs import MoeTileConfig

    moe = layer["moe"]
    per_expert = tokens * moe.top_k / moe.num_experts
    rows = [m for m in (16, 32, 64, 128) if m == 16 or m <= 4 * per_expert]
    grid = itertools.product(rows, (64, 128, 256), (64, 128), (4, 8), (3, 4))
    return [
        MoeTileConfig(block_m=m, block_n=n, block_k=k, group_m=8, num_warps=w, num_stages=s)
        for m, n, k, w, s in grid
        if m * n * k <= 64 * 256 * 128  # the larger ones are beyond the shared memory at 4 stages
    ]


def _tile_us(fused_moe: Any, operands: tuple[torch.Tensor, ...], tiles: Any) -> float:
    return median_us_clean_l2(lambda: fused_moe(*operands, tiles), "cuda", use_graph=True, reps=30)


def tune(args: argparse.Namespace) -> None:
    from prefixgrove_kernels.fused_moe import fused_moe
    from prefixgrove_kernels.moe_configs import moe_shape, tile_config

    layer = _layer(args)
    w_gate_up, w_down = layer["w_gate_up"], layer["w_down"]
    table: dict[int, Any] = {}
    for tokens in args.tokens:
        x, _, weights, ids = _routed(layer, tokens)
        timings = []
        for tiles in [tile_config(moe_shape(x, w_gate_up), tokens), *_tile_grid(tokens, layer)]:
            try:
                us = _tile_us(fused_moe, (x, w_gate_up, w_down, ids, weights), tiles)
            except Exception as error:  # out of shared memory, say: this tile does not run here
                print(f"tile {tiles} at {tokens} tokens: {type(error).__name__}", flush=True)
                continue
            timings.append((us, tiles))
        current_us = timings[0][0]
        best_us, best = min(timings, key=lambda t: t[0])
        table[tokens] = best
        emit({
            "bench": "moe.tune", "device": device_name(), "model": args.model, "tokens": tokens,
            "best": repr(best), "best_us": round(best_us, 1), "table_us": round(current_us, 1),
            "speedup_over_table": round(current_us / best_us, 3),
        })  # fmt: skip
    key = moe_shape(x, w_gate_up)
    emit(
        {
            "bench": "moe.tune.table",
            "key": repr(key),
            "tiles": {t: repr(c) for t, c in table.items()},
        }
    )


def _per_expert_loop(self: Any, x: torch.Tensor) -> torch.Tensor:
    """SparseMoe.forward as a per-expert loop (transformers' way): route, then each routed
    expert's tokens through its own matmuls, weighted and summed."""
    from prefixgrove.engine.models.moe import route

    logits = torch.nn.functional.linear(x, self.gate.weight)
    weights, ids = route(logits, self.moe.top_k, self.moe.norm_topk_prob)
    weights = weights.to(self.weight_dtype or x.dtype)
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == expert)
        gate, up = torch.nn.functional.linear(x[rows], self.experts_gate_up[expert]).chunk(2, -1)
        y = torch.nn.functional.linear(
            torch.nn.functional.silu(gate) * up, self.experts_down[expert]
        )
        out.index_add_(0, rows, (y * weights[rows, slot, None]).to(x.dtype))
    return self._with_shared_expert(x, out)


def canonical(args: argparse.Namespace) -> None:
    import batchllm

    from prefixgrove.engine.models.moe import SparseMoe

    prompts = shared_prefix_prompts(
        args.groups, args.per_group, args.prefix_len, args.suffix_len, 128256, seed=0
    )
    random.Random(1).shuffle(prompts)
    fused_forward = SparseMoe.forward
    records = {}
    for way, eager, forward in (
        ("fused", False, fused_forward),
        ("fused-eager", True, fused_forward),
        ("per-expert-loop", True, _per_expert_loop),
    ):
        SparseMoe.forward = forward  # type: ignore[method-assign]
        args.enforce_eager = eager
        try:
            record = batchllm.run_mode("group-cascade", prompts, args)
        finally:
            SparseMoe.forward = fused_forward  # type: ignore[method-assign]
        records[way] = record
        emit({**record, "bench": "moe.canonical", "model": args.model, "way": way})
        gc.collect()
        torch.cuda.empty_cache()
    loop = records["per-expert-loop"]["requests_per_s"]
    emit({
        "bench": "moe.canonical.ratios", "device": device_name(), "model": args.model,
        "requests": len(prompts),
        **{f"{way}_over_loop": round(r["requests_per_s"] / loop, 2) for way, r in records.items()},
    })  # fmt: skip


def main() -> None:
    ensure_prefixgrove()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["roofline", "tune", "canonical"])
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=None)
    add_canonical_args(ap, groups=32)  # one wave of 512: the per-expert loop takes minutes
    ap.set_defaults(model="qwen3-30b-a3b-random")
    args = ap.parse_args()
    defaults = {"roofline": [64, 256, 512, 4096], "tune": [1, 16, 64, 128, 256, 512, 1024, 4096]}
    args.tokens = args.tokens or defaults.get(args.what, [])
    {"roofline": roofline, "tune": tune, "canonical": canonical}[args.what](args)


if __name__ == "__main__":
    main()
