"""Cascade decode attention against plain paged attention: the one-pass kernel and the two-pass form.

Each request has one query token (decode), a prefix shared by `degree` requests and its own
`--own-tokens` tokens; the batch holds `--requests` requests, i.e. requests / degree groups.
Prints one JSON object: timings (microseconds, median over 200 calls, by default each a CUDA graph of
the calls, as the engine runs them, and each after a 256 MB read that leaves the L2 cold and clean,
as the engine's attention finds it after the QKV projection) of the plain kernel, the one-pass
cascade decode kernel (what the engine's decode steps run) and the two-pass cascade (prefix pass,
then a suffix pass that merges: what steps with prefill rows run), the KV bytes each must read and
the GB/s that makes, the speedups, and the largest difference from the plain result. The plain and
one-pass times are also given as triton.testing.do_bench takes them (`*_dirty_l2`: its L2 flush
writes 256 MB, and the timed kernel then writes those dirty lines back; the earlier rounds' figures
in HISTORY.md were taken that way). On a GPU each point also carries the machine's read ceiling
(`_read_ceiling.py`): the time a plain streaming read of the one-pass kernel's KV bytes takes, the
fraction of it the one-pass kernel reaches, and the speed-up over the plain kernel that a kernel
reading those bytes at the ceiling would have (`read_ceiling_us`, `one_pass_of_ceiling`,
`speedup_bound`).
With `--kv-cache-dtype fp8` the caches hold the same random values as FP8 e4m3 codes under the
scale the engine gives an FP8 cache, and every kernel reads them as the engine's do: one byte per
cached value, so the KV bytes, the GB/s and the read ceiling are those of half the bytes. Every
result names its cache's element type (`kv_dtype`).

    python benchmarks/attention_kernels.py            # full sweep (degrees 4/16/64 x 512/2000/8000)
    python benchmarks/attention_kernels.py --quick    # degree 16 and 64 at 2000 tokens
    python benchmarks/attention_kernels.py --quick --kv-cache-dtype fp8   # the same on an FP8 cache
    TRITON_INTERPRET=1 python benchmarks/attention_kernels.py --device cpu --dtype float16 \
        --requests 8 --degrees 4 --prefix-lens 64 --own-tokens 16   # smoke run without a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import triton

from _common import ensure_prefixgrove, median_us, median_us_clean_l2
from _read_ceiling import read_ceiling_us

ensure_prefixgrove()


from prefixgrove_kernels.cascade_attention import prefix_attention  # noqa: E402
from prefixgrove_kernels.cascade_decode import cascade_decode_attention  # noqa: E402
from prefixgrove_kernels.checks import FP8_KV_DTYPE  # noqa: E402
from prefixgrove_kernels.launch import CascadeMetadata, PagedMetadata  # noqa: E402
from prefixgrove_kernels.paged_attention import paged_attention  # noqa: E402
from prefixgrove_kernels.reference_math import quantize_kv  # noqa: E402

TARGET = {"degree": 16, "prefix_len": 2000, "min_speedup": 3.0}
# The scale of every FP8 cache the engine allocates (attention/kv_cache.py: vLLM's without
# calibrated scales); random values of order one then sit on codes of order one.
ENGINE_FP8_KV_SCALE = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="degrees 16 and 64 at 2000 tokens")
    p.add_argument("--degrees", type=int, nargs="+", default=None)
    p.add_argument("--prefix-lens", type=int, nargs="+", default=None)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--own-tokens", type=int, default=200, help="per request, new token included")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="auto: caches in --dtype; fp8: e4m3 codes with a per-tensor scale, as the engine's",
    )
    p.add_argument("--num-splits", type=int, default=None, help="prefix splits (default: auto)")
    p.add_argument("--no-graph", action="store_true", help="time eager calls, not CUDA graphs")
    p.add_argument("--device", default="cuda")
    p.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.degrees is None:
        args.degrees = [16, 64] if args.quick else [4, 16, 64]
    if args.prefix_lens is None:
        args.prefix_lens = [2000] if args.quick else [512, 2000, 8000]
    return args


def kv_dtype(args: argparse.Namespace) -> torch.dtype:
    """The element type of the caches the kernels read: --dtype's, or e4m3 for an FP8 cache."""
    return FP8_KV_DTYPE if args.kv_cache_dtype == "fp8" else getattr(torch, args.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def random_cache(
    shape: tuple[int, ...], args: argparse.Namespace, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A k or v cache of `shape` holding random values in --dtype, and its scale: with
    --kv-cache-dtype fp8 those values as e4m3 codes under the engine's scale (a float32 tensor of
    one value, as the kernels take it), else the values themselves and None."""
    values = torch.randn(shape, device=device, dtype=getattr(torch, args.dtype))
    if args.kv_cache_dtype == "auto":
        return values, None
    scale = torch.full((1,), ENGINE_FP8_KV_SCALE, dtype=torch.float32, device=device)
    return quantize_kv(values, scale), scale


class Workload:
    """One sweep point: the paged cache, decode queries and both paths' metadata."""

    def __init__(self, args: argparse.Namespace, degree: int, prefix_len: int) -> None:
        device, dtype, bs = torch.device(args.device), getattr(torch, args.dtype), args.block_size
        self.num_groups = max(1, args.requests // degree)
        self.num_requests = self.num_groups * degree
        self.prefix_len = math.ceil(prefix_len / bs) * bs  # prefixes are whole blocks
        prefix_blocks = self.prefix_len // bs
        own_blocks = math.ceil(args.own_tokens / bs)
        num_blocks = self.num_groups * prefix_blocks + self.num_requests * own_blocks
        shape = (num_blocks, bs, args.kv_heads, args.head_dim)
        # k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]
        self.k_cache, self.k_scale = random_cache(shape, args, device)
        self.v_cache, self.v_scale = random_cache(shape, args, device)
        self.q = torch.randn(self.num_requests, args.heads, args.head_dim, device=device).to(dtype)
        order = torch.randperm(num_blocks, device="cpu").to(torch.int32)
        prefix_ids = order[: self.num_groups * prefix_blocks].view(self.num_groups, -1)
        own_ids = order[self.num_groups * prefix_blocks :].view(self.num_requests, -1)
        per_request_prefix = prefix_ids.repeat_interleave(degree, dim=0)
        int32: dict[str, Any] = {"dtype": torch.int32, "device": device}
        self.block_tables = torch.cat([per_request_prefix, own_ids], dim=1).to(device)
        self.cu_seqlens_q = torch.arange(self.num_requests + 1, **int32)
        self.seq_lens = torch.full((self.num_requests,), self.prefix_len + args.own_tokens, **int32)
        self.kv_start = torch.full((self.num_requests,), self.prefix_len, **int32)
        self.group_cu_q = torch.arange(0, self.num_requests + 1, degree, **int32)
        self.group_prefix_lens = torch.full((self.num_groups,), self.prefix_len, **int32)
        self.group_block_tables = prefix_ids.to(device)
        self.degree, self.scale, self.num_splits = degree, args.head_dim**-0.5, args.num_splits
        self.plain_meta = PagedMetadata(
            cu_seqlens_q=self.cu_seqlens_q,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            max_query_len=1,
        )
        self.meta = dataclasses.replace(self.plain_meta, kv_start=self.kv_start)
        self.groups = CascadeMetadata(
            group_cu_q=self.group_cu_q,
            group_prefix_lens=self.group_prefix_lens,
            group_block_tables=self.group_block_tables,
            max_group_q=degree,
        )
        self.plain_out = torch.empty_like(self.q)
        self.cascade_out = torch.empty_like(self.q)
        self.one_pass_out = torch.empty_like(self.q)
        self.o_p = torch.empty(self.q.shape, dtype=torch.float32, device=device)
        self.lse_p = torch.empty(self.q.shape[:2], dtype=torch.float32, device=device)
        row_bytes = 2 * args.kv_heads * args.head_dim * self.k_cache.element_size()  # K and V
        own = self.num_requests * args.own_tokens
        self.plain_bytes = row_bytes * self.num_requests * (self.prefix_len + args.own_tokens)
        self.prefix_bytes = row_bytes * self.num_groups * self.prefix_len
        self.suffix_bytes = row_bytes * own

    def plain(self) -> None:
        paged_attention(
            self.q, self.k_cache, self.v_cache, self.plain_out, self.plain_meta, scale=self.scale,
            k_scale=self.k_scale, v_scale=self.v_scale,
        )  # fmt: skip

    def prefix_pass(self) -> None:
        prefix_attention(
            self.q, self.k_cache, self.v_cache, self.groups, scale=self.scale, out=self.o_p,
            out_lse=self.lse_p, num_splits=self.num_splits, k_scale=self.k_scale,
            v_scale=self.v_scale,
        )  # fmt: skip

    def suffix_pass(self) -> None:
        paged_attention(
            self.q, self.k_cache, self.v_cache, self.cascade_out, self.meta, scale=self.scale,
            prefix_out=self.o_p, prefix_lse=self.lse_p, k_scale=self.k_scale, v_scale=self.v_scale,
        )  # fmt: skip

    def cascade(self) -> None:
        self.prefix_pass()
        self.suffix_pass()

    def one_pass(self) -> None:
        cascade_decode_attention(
            self.q, self.k_cache, self.v_cache, self.one_pass_out, self.meta, self.groups,
            scale=self.scale, k_scale=self.k_scale, v_scale=self.v_scale,
        )  # fmt: skip


def measure(args: argparse.Namespace, degree: int, prefix_len: int) -> dict[str, Any]:
    w = Workload(args, degree, prefix_len)
    w.plain()
    w.cascade()
    w.one_pass()
    if args.device != "cpu":
        torch.cuda.synchronize()
    diff = max(
        (out.float() - w.plain_out.float()).abs().max().item()
        for out in (w.cascade_out, w.one_pass_out)
    )
    use_graph = not args.no_graph
    calls = [
        ("plain_us", w.plain),
        ("one_pass_us", w.one_pass),
        ("two_pass_us", w.cascade),
        ("prefix_pass_us", w.prefix_pass),
        ("suffix_pass_us", w.suffix_pass),
    ]
    times = {name: median_us_clean_l2(fn, args.device, use_graph) for name, fn in calls}
    dirty = {f"{name}_dirty_l2": median_us(fn, args.device, use_graph) for name, fn in calls[:2]}
    cascade_bytes = w.prefix_bytes + w.suffix_bytes
    ceiling = {}
    if args.device != "cpu":  # the interpreter's wall time would bound nothing
        read_us = read_ceiling_us(cascade_bytes, args.device)
        ceiling = {
            "read_ceiling_us": round(read_us, 2),
            "one_pass_of_ceiling": round(read_us / times["one_pass_us"], 3),
            "speedup_bound": round(times["plain_us"] / read_us, 2),
        }
    return {
        "degree": degree,
        "prefix_len": w.prefix_len,
        "groups": w.num_groups,
        "requests": w.num_requests,
        "kv_dtype": dtype_name(w.k_cache.dtype),
        **{k: round(v, 2) for k, v in {**times, **dirty}.items()},
        "speedup": round(times["plain_us"] / times["one_pass_us"], 2),
        "speedup_dirty_l2": round(dirty["plain_us_dirty_l2"] / dirty["one_pass_us_dirty_l2"], 2),
        "two_pass_speedup": round(times["plain_us"] / times["two_pass_us"], 2),
        "plain_kv_mb": round(w.plain_bytes / 1e6, 1),
        "cascade_kv_mb": round(cascade_bytes / 1e6, 1),
        "plain_gb_per_s": round(w.plain_bytes / times["plain_us"] / 1e3, 1),
        "one_pass_gb_per_s": round(cascade_bytes / times["one_pass_us"] / 1e3, 1),
        "two_pass_gb_per_s": round(cascade_bytes / times["two_pass_us"] / 1e3, 1),
        "prefix_pass_gb_per_s": round(w.prefix_bytes / times["prefix_pass_us"] / 1e3, 1),
        "suffix_pass_gb_per_s": round(w.suffix_bytes / times["suffix_pass_us"] / 1e3, 1),
        **ceiling,
        "max_abs_diff_vs_plain": diff,
    }


def environment(args: argparse.Namespace) -> dict[str, Any]:
    on_gpu = args.device != "cpu"
    timing = "cpu wall"
    if on_gpu:
        calls = "eager calls" if args.no_graph else "cuda graphs"
        timing = f"{calls}, cold clean L2 (and do_bench's dirty L2 for *_dirty_l2)"
    return {
        "device": torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "timing": timing,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device; use --device cpu for a smoke run"}))
        return 1
    config = {k: v for k, v in vars(args).items() if k not in ("output",)}
    report: dict[str, Any] = {**environment(args), "config": config, "results": []}
    tolerance = 5e-2 if args.dtype == "bfloat16" else 1e-2
    failed = False
    for degree in args.degrees:
        for prefix_len in args.prefix_lens:
            try:
                result = measure(args, degree, prefix_len)
                result["matches_plain"] = result["max_abs_diff_vs_plain"] <= tolerance
                failed |= not result["matches_plain"]
            except Exception as e:  # keep sweeping; report what failed and why
                failed = True
                result = {
                    "degree": degree,
                    "prefix_len": prefix_len,
                    "kv_dtype": dtype_name(kv_dtype(args)),
                    "error": repr(e),
                }
                traceback.print_exc(file=sys.stderr)
            report["results"].append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
            if args.device != "cpu":
                torch.cuda.empty_cache()
    at_target = [
        r for r in report["results"]
        if r.get("degree") == TARGET["degree"] and r.get("prefix_len") == TARGET["prefix_len"]
    ]  # fmt: skip
    if at_target and "speedup" in at_target[0]:
        report["target"] = {**TARGET, "met": at_target[0]["speedup"] >= TARGET["min_speedup"]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
