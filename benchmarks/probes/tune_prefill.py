"""Sweeps tile shapes and launch options of the attention kernels as chunked prefill uses them.

The canonical workload's prefill steps hold three kinds of attention: group prefixes computed as ordinary
causal prefills (`--prefix-len` tokens each), the cascade prefix pass of a group's suffix tokens over its
prefix (a [group tokens x prefix] non-causal product), and the suffix pass (each request's own tokens,
causal, merged with the prefix state). The engine runs the prefixes' prefills and the suffix pass as one
launch (`mixed_step`), timed also against the same launch with every program on the masked key loop,
and the whole step's attention (prefix pass + that launch) with the suffix chunks finished in the
prefix pass (fused, the engine's default on CUDA) against two passes.
Each variant is timed with do_bench (median, no graph: prefill runs eagerly) and checked against the
default launch's output. Prints one JSON object with the best variants of each kind, TFLOP/s included.
Usage: cd benchmarks && python -m probes.tune_prefill [--groups 4] [--per-group 16] [--prefix-len 2000] [--suffix-len 200]
       [--quick] [--state-dtype model|float32] [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from _common import ensure_prefixgrove, median_us

ensure_prefixgrove()

from prefixgrove_kernels import cascade_attention, paged_attention  # noqa: E402
from prefixgrove_kernels.launch import CascadeMetadata, PagedMetadata, SuffixChunks  # noqa: E402
from prefixgrove_kernels.reference_math import quantize_kv  # noqa: E402


class PrefillWorkload:
    def __init__(self, args: argparse.Namespace) -> None:
        self.dev, self.dt, self.bs = "cuda", torch.bfloat16, 16
        self.g, self.d, self.p, self.s = (
            args.groups,
            args.per_group,
            args.prefix_len,
            args.suffix_len,
        )
        self.heads, self.kv_heads, self.dim = 32, 8, 128
        self.i32: dict[str, Any] = {"dtype": torch.int32, "device": self.dev}
        self.scale = self.dim**-0.5
        self.fp8 = args.kv_cache_dtype == "fp8"
        # The prefix state: in the model's dtype as the engine keeps it, or fp32 (--state-dtype).
        self.state_dtype = self.dt if args.state_dtype == "model" else torch.float32
        prefix_ids, own_ids = self._cache()
        self._prefix_prefill(prefix_ids)
        tables = self._suffix(prefix_ids, own_ids)
        self._mixed_step(prefix_ids, tables)
        self._flops()

    def _cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fills the KV cache; returns the groups' prefix blocks and the requests' own blocks."""
        g, d, bs = self.g, self.d, self.bs
        prefix_blocks, own_blocks = self.p // bs, -(-self.s // bs)
        num_blocks = g * prefix_blocks + g * d * own_blocks + 1
        shape = (num_blocks, bs, self.kv_heads, self.dim)
        self.k = torch.randn(shape, device=self.dev, dtype=self.dt)
        self.v = torch.randn(shape, device=self.dev, dtype=self.dt)
        # Every kernel call takes the cache's scales: an FP8 cache's (the engine's 1.0), or none.
        self.kv: dict[str, torch.Tensor] = {}
        if self.fp8:
            one = torch.ones(1, dtype=torch.float32, device=self.dev)
            self.k, self.v = quantize_kv(self.k, one), quantize_kv(self.v, one)
            self.kv = {"k_scale": one, "v_scale": one}
        ids = torch.randperm(num_blocks - 1, device="cpu").to(torch.int32) + 1
        prefix_ids = ids[: g * prefix_blocks].view(g, prefix_blocks)
        return prefix_ids, ids[g * prefix_blocks :].view(g * d, own_blocks)

    def _prefix_prefill(self, prefix_ids: torch.Tensor) -> None:
        """Prefix prefill: g sequences of p tokens, causal from position 0."""
        g, p, i32 = self.g, self.p, self.i32
        self.pq = torch.randn(g * p, self.heads, self.dim, device=self.dev, dtype=self.dt)
        self.pout = torch.empty_like(self.pq)
        self.p_meta = PagedMetadata(
            cu_seqlens_q=torch.arange(0, g * p + 1, p, **i32),
            seq_lens=torch.full((g,), p, **i32),
            block_tables=prefix_ids.to(self.dev),
            max_query_len=p,
        )

    def _suffix(self, prefix_ids: torch.Tensor, own_ids: torch.Tensor) -> torch.Tensor:
        """Suffix tokens: g * d requests of s tokens after the prefix; returns their block tables."""
        g, d, p, s, i32, dev = self.g, self.d, self.p, self.s, self.i32, self.dev
        n = g * d
        self.sq = torch.randn(n * s, self.heads, self.dim, device=dev, dtype=self.dt)
        self.sout = torch.empty_like(self.sq)
        self.o_p = torch.empty(self.sq.shape, dtype=self.state_dtype, device=dev)
        self.lse_p = torch.empty(self.sq.shape[:2], dtype=torch.float32, device=dev)
        self.groups = CascadeMetadata(
            group_cu_q=torch.arange(0, n * s + 1, d * s, **i32),
            group_prefix_lens=torch.full((g,), p, **i32),
            group_block_tables=prefix_ids.to(dev),
            max_group_q=d * s,
        )
        tables = torch.cat([prefix_ids.repeat_interleave(d, dim=0), own_ids], dim=1)
        self.s_meta = PagedMetadata(
            cu_seqlens_q=torch.arange(0, n * s + 1, s, **i32),
            seq_lens=torch.full((n,), p + s, **i32),
            kv_start=torch.full((n,), p, **i32),
            block_tables=tables.to(dev),
            max_query_len=1 << (s - 1).bit_length(),
        )
        # Without cascade: the same suffix tokens over prefix and own keys in one causal pass.
        self.plain_out = torch.empty_like(self.sq)
        self.plain_meta = dataclasses.replace(self.s_meta, kv_start=None)
        return tables

    def _mixed_step(self, prefix_ids: torch.Tensor, tables: torch.Tensor) -> None:
        """The step as the engine lays it out: grouped rows first (the suffix chunks), then the new
        prefixes' prompts (kv_start 0: no prefix state)."""
        g, p, i32, dev = self.g, self.p, self.i32, self.dev
        prefix_blocks = prefix_ids.shape[1]
        padded = torch.zeros(g, max(prefix_blocks, tables.shape[1]), dtype=torch.int32)
        padded[:, :prefix_blocks] = prefix_ids
        self.step_q = torch.cat([self.sq, self.pq])
        self.step_out = torch.empty_like(self.step_q)
        self.step_state = torch.empty_like(self.step_q)
        self.step_lse = torch.empty(self.step_q.shape[:2], dtype=torch.float32, device=dev)
        step_lens = [self.s] * (g * self.d) + [p] * g
        assert self.s_meta.kv_start is not None
        self.step_meta = PagedMetadata(
            cu_seqlens_q=torch.tensor([0, *itertools.accumulate(step_lens)], **i32),
            seq_lens=torch.cat([self.s_meta.seq_lens, self.p_meta.seq_lens]),
            kv_start=torch.cat([self.s_meta.kv_start, torch.zeros(g, **i32)]),
            block_tables=torch.cat([tables, padded]).to(dev),
            max_query_len=p,
        )
        # The engine's paged launch in a mixed step (two passes): the new prefixes' causal prefills
        # and the suffix pass merging the chunks' prefix state.
        self.mout = torch.empty_like(self.step_q)
        self.m_state = {
            "prefix_out": torch.zeros(self.step_q.shape, dtype=self.state_dtype, device=dev),
            "prefix_lse": torch.zeros(self.step_q.shape[:2], device=dev),
        }

    def _flops(self) -> None:
        """Attention FLOPs (QK^T and PV, causal halves counted once)."""
        g, p, s, n = self.g, self.p, self.s, self.g * self.d
        per_head = 4 * self.dim * self.heads
        self.flops = {
            "prefix_prefill": g * per_head * p * (p + 1) / 2,
            "prefix_pass": n * s * p * per_head,
            "suffix_pass": n * per_head * s * (s + 1) / 2,
            "plain_suffix": n * per_head * s * (p + (s + 1) / 2),
        }
        self.flops["mixed_step"] = self.flops["prefix_prefill"] + self.flops["suffix_pass"]
        self.flops["step"] = self.flops["mixed_step"] + self.flops["prefix_pass"]

    def prefix_prefill(self) -> None:
        paged_attention.paged_attention(
            self.pq, self.k, self.v, self.pout, self.p_meta, scale=self.scale, **self.kv
        )

    def mixed_step(self, **overrides: Any) -> None:
        launch = paged_attention.paged_attention_launch(
            self.step_q, self.k, self.v, self.mout, self.step_meta, scale=self.scale,
            **self.m_state, **self.kv,
        )  # fmt: skip
        assert launch is not None
        launch._replace(options={**launch.options, **overrides}).run()

    def step(self, fused: bool) -> None:
        """The step's cascade attention, two passes or with the suffix chunks fused."""
        chunks = SuffixChunks(self.step_out, self.step_meta) if fused else None
        state, lse = cascade_attention.prefix_attention(
            self.step_q, self.k, self.v, self.groups, scale=self.scale, out=self.step_state,
            out_lse=self.step_lse, suffix_chunks=chunks, **self.kv,
        )  # fmt: skip
        paged_attention.paged_attention(
            self.step_q, self.k, self.v, self.step_out, self.step_meta, scale=self.scale,
            prefix_out=state, prefix_lse=lse, skip_suffix_chunks=fused, **self.kv,
        )  # fmt: skip

    def plain_suffix(self) -> None:
        paged_attention.paged_attention(
            self.sq, self.k, self.v, self.plain_out, self.plain_meta, scale=self.scale, **self.kv
        )

    def prefix_pass(self) -> None:
        cascade_attention.prefix_attention(
            self.sq, self.k, self.v, self.groups, scale=self.scale, out=self.o_p,
            out_lse=self.lse_p, **self.kv,
        )  # fmt: skip

    def suffix_pass(self) -> None:
        paged_attention.paged_attention(
            self.sq, self.k, self.v, self.sout, self.s_meta, scale=self.scale, prefix_out=self.o_p,
            prefix_lse=self.lse_p, **self.kv,
        )  # fmt: skip


def sweep(
    module: Any, fn: Callable[[], None], out: torch.Tensor, flops: float, space: list[tuple]
) -> list[dict]:
    fn()
    torch.cuda.synchronize()
    ref = out.float().clone()
    original_shape, original_launch = module._tile_shape, module.KernelLaunch
    rows = []
    for block_m, block_n, warps, stages in space:
        module._tile_shape = lambda *a, bm=block_m, bn=block_n: (bm, bn)

        class Launch(original_launch):  # type: ignore[misc, valid-type]
            def run(self, w: int = warps, st: int = stages) -> None:
                opts = dict(self.options)
                if self.kernel is not cascade_attention.reduce_splits_kernel:
                    opts.update(num_warps=w, num_stages=st)
                self.kernel[self.grid](*self.args, **opts)

        module.KernelLaunch = Launch
        row: dict[str, Any] = {"BLOCK_M": block_m, "BLOCK_N": block_n, "warps": warps}
        row["stages"] = stages
        try:
            fn()
            torch.cuda.synchronize()
            row["err"] = (out.float() - ref).abs().max().item()
            us = median_us(fn, "cuda", False)
            row.update(us=round(us, 1), tflops=round(flops / us / 1e6, 1))
        except Exception as e:  # a variant that does not fit: say why, keep sweeping
            row["error"] = repr(e)[:100]
        finally:
            module._tile_shape, module.KernelLaunch = original_shape, original_launch
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--suffix-len", type=int, default=200)
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument(
        "--state-dtype",
        choices=["model", "float32"],
        default="model",
        help="dtype of the prefix pass's output that the suffix pass merges (the engine: model)",
    )
    ap.add_argument("--quick", action="store_true", help="defaults only, no sweep")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    args = ap.parse_args()
    w = PrefillWorkload(args)
    space = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)))
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "config": vars(args)}
    for name, module, fn, out in (
        ("prefix_prefill", paged_attention, w.prefix_prefill, w.pout),
        ("prefix_pass", cascade_attention, w.prefix_pass, w.o_p),
        ("suffix_pass", paged_attention, w.suffix_pass, w.sout),
        ("plain_suffix", paged_attention, w.plain_suffix, w.plain_out),
        ("mixed_step", paged_attention, w.mixed_step, w.mout),
    ):
        default_us = median_us(fn, "cuda", False)
        rows = [] if args.quick else sweep(module, fn, out, w.flops[name], space)
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        report[name] = {
            "default_us": round(default_us, 1),
            "default_tflops": round(w.flops[name] / default_us / 1e6, 1),
            "best": ok[: args.top],
            "errors": [r for r in rows if "error" in r][:2],
        }
        print(json.dumps({name: report[name]}), file=sys.stderr, flush=True)
    # The mixed step's launch with every program on the masked loop (as before the whole-tile loop
    # was allowed beside kv_start), against the default, alternating.
    masked = functools.partial(w.mixed_step, UNMASKED_BODY=False)
    pairs = [
        (median_us(w.mixed_step, "cuda", False), median_us(masked, "cuda", False)) for _ in range(3)
    ]
    report["mixed_step_vs_masked_loop_us"] = [[round(a, 1), round(b, 1)] for a, b in pairs]
    # The whole step: two passes against the suffix chunks fused into the prefix pass, alternating.
    two_pass, fused = (functools.partial(w.step, fused=f) for f in (False, True))
    two_pass()
    want = w.step_out.float().clone()
    fused()
    pairs = [
        (median_us(two_pass, "cuda", False), median_us(fused, "cuda", False)) for _ in range(3)
    ]
    report["step_two_pass_vs_fused_us"] = [[round(a, 1), round(b, 1)] for a, b in pairs]
    report["step_fused_tflops"] = round(w.flops["step"] / min(b for _, b in pairs) / 1e6, 1)
    report["step_fused_max_abs_diff"] = (w.step_out.float() - want).abs().max().item()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
