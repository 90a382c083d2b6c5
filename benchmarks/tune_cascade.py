"""Sweeps the launch options of cascade decode attention's two passes on one workload point.

For the prefix pass: splits, BLOCK_N, num_warps, num_stages; for the suffix pass (the paged kernel with a
prefix state to merge): BLOCK_N, num_warps, num_stages. Each variant is timed like attention_kernels.py
(median of do_bench over a CUDA graph) and checked against the default launch's output. Prints one JSON
object with every variant sorted by time. The defaults in kernels/ come from these sweeps.
Usage: python benchmarks/tune_cascade.py [--degree 16] [--prefix-len 2000]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Any

import torch

from _common import ensure_prefixgrove, median_us

ensure_prefixgrove()

from attention_kernels import Workload, parse_args  # noqa: E402

from prefixgrove.kernels.cascade_attention import prefix_attention_launches  # noqa: E402
from prefixgrove.kernels.paged_attention import paged_attention_launch  # noqa: E402


def prefix_launches(w: Workload, splits: int, overrides: dict[str, Any]) -> list:
    launches, _, _ = prefix_attention_launches(
        w.q, w.k_cache, w.v_cache, group_cu_q=w.group_cu_q,
        group_prefix_lens=w.group_prefix_lens, group_block_tables=w.group_block_tables,
        scale=w.scale, max_group_q=w.degree, out=w.o_p, out_lse=w.lse_p, num_splits=splits,
    )  # fmt: skip
    first = launches[0]
    launches[0] = first._replace(options={**first.options, **overrides})
    return launches


def suffix_launch(w: Workload, overrides: dict[str, Any]):
    launch = paged_attention_launch(
        w.q, w.k_cache, w.v_cache, w.cascade_out, cu_seqlens_q=w.cu_seqlens_q,
        seq_lens=w.seq_lens, block_tables=w.block_tables, scale=w.scale, max_query_len=1,
        kv_start=w.kv_start, prefix_out=w.o_p, prefix_lse=w.lse_p,
    )  # fmt: skip
    assert launch is not None
    return launch._replace(options={**launch.options, **overrides})


def run_all(launches: list) -> None:
    for launch in launches:
        launch.run()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--degree", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--top", type=int, default=8)
    own, rest = ap.parse_known_args()
    args = parse_args(rest)
    w = Workload(args, own.degree, own.prefix_len)
    w.prefix_pass()
    w.suffix_pass()
    torch.cuda.synchronize()
    ref_p, ref_out = w.o_p.clone(), w.cascade_out.clone()

    prefix_rows = []
    for splits, block_n, warps, stages in itertools.product(
        (1, 2, 4, 8), (32, 64, 128), (4, 8), (2, 3, 4)
    ):
        opts = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        try:
            launches = prefix_launches(w, splits, opts)
            run_all(launches)
            torch.cuda.synchronize()
            err = (w.o_p - ref_p).abs().max().item()
            us = median_us(lambda ls=launches: run_all(ls), "cuda", True)
        except Exception as e:  # e.g. out of shared memory: skip the variant, say why
            prefix_rows.append({"splits": splits, **opts, "error": repr(e)[:120]})
            continue
        gbps = w.prefix_bytes / us / 1e3
        prefix_rows.append(
            {"splits": splits, **opts, "us": round(us, 1), "gb_s": round(gbps), "err": err}
        )

    suffix_rows = []
    for block_n, warps, stages in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (2, 3, 4)):
        opts = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        try:
            launch = suffix_launch(w, opts)
            launch.run()
            torch.cuda.synchronize()
            err = (w.cascade_out.float() - ref_out.float()).abs().max().item()
            us = median_us(launch.run, "cuda", True)
        except Exception as e:
            suffix_rows.append({**opts, "error": repr(e)[:120]})
            continue
        gbps = w.suffix_bytes / us / 1e3
        suffix_rows.append({**opts, "us": round(us, 1), "gb_s": round(gbps), "err": err})

    def best(rows: list[dict]) -> list[dict]:
        ok = [r for r in rows if "us" in r]
        return sorted(ok, key=lambda r: r["us"])[: own.top]

    report = {
        "device": torch.cuda.get_device_name(),
        "degree": own.degree,
        "prefix_len": w.prefix_len,
        "requests": w.num_requests,
        "prefix_best": best(prefix_rows),
        "suffix_best": best(suffix_rows),
        "errors": [r for r in prefix_rows + suffix_rows if "error" in r][:4],
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
