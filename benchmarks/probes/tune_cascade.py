"""Sweeps the launch options of cascade decode attention on one workload point.

Two passes (the default): for the prefix pass, splits, BLOCK_N, num_warps, num_stages; for the suffix
pass (the paged kernel with a prefix state to merge), BLOCK_N, num_warps, num_stages. With --one-pass:
the one-pass kernel's splits, BLOCK_N, num_stages, CHUNK_TILES, num_warps and a register cap. Each
variant is timed over a CUDA graph (the one-pass variants from a cold, clean L2 as attention_kernels.py
times them, the two passes' with do_bench) and checked against the default launch's output. Prints one
JSON object with the fastest variants and the default's time. The defaults in kernels/ come from these
sweeps.
Usage: cd benchmarks && python -m probes.tune_cascade [--degree 16] [--prefix-len 2000] [--one-pass] [--warps 4 8] [--requests 256]
       [--kv-cache-dtype fp8] (any attention_kernels.py option: the workload is its)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Any

import torch

from _common import device_name, ensure_prefixgrove, median_us, median_us_clean_l2

ensure_prefixgrove()

from attention_kernels import Workload, parse_args  # noqa: E402

from prefixgrove_kernels.cascade_attention import prefix_attention_launches  # noqa: E402
from prefixgrove_kernels.cascade_decode import cascade_decode_attention_launches  # noqa: E402
from prefixgrove_kernels.paged_attention import paged_attention_launch  # noqa: E402


def prefix_launches(w: Workload, splits: int, overrides: dict[str, Any]) -> list:
    launches, _, _ = prefix_attention_launches(
        w.q, w.k_cache, w.v_cache, w.groups, scale=w.scale, out=w.o_p, out_lse=w.lse_p,
        num_splits=splits, k_scale=w.k_scale, v_scale=w.v_scale,
    )  # fmt: skip
    first = launches[0]
    launches[0] = first._replace(options={**first.options, **overrides})
    return launches


def suffix_launch(w: Workload, overrides: dict[str, Any]):
    launch = paged_attention_launch(
        w.q, w.k_cache, w.v_cache, w.cascade_out, w.meta, scale=w.scale, prefix_out=w.o_p,
        prefix_lse=w.lse_p, k_scale=w.k_scale, v_scale=w.v_scale,
    )  # fmt: skip
    assert launch is not None
    return launch._replace(options={**launch.options, **overrides})


def one_pass_launches(w: Workload, splits: int | None, overrides: dict[str, Any]) -> list:
    launches = cascade_decode_attention_launches(
        w.q, w.k_cache, w.v_cache, w.one_pass_out, w.meta, w.groups, scale=w.scale,
        num_splits=splits, k_scale=w.k_scale, v_scale=w.v_scale,
    )  # fmt: skip
    first = launches[0]
    launches[0] = first._replace(options={**first.options, **overrides})
    return launches


def sweep_one_pass(w: Workload, own: argparse.Namespace) -> dict[str, Any]:
    """The one-pass kernel's variants at this point, against its default launch."""
    w.one_pass()
    _sync(w)
    ref = w.one_pass_out.clone()
    default = one_pass_launches(w, None, {})
    num_splits = default[0].args[15]  # the launcher's pick
    rows = [
        {"default": True, "splits": num_splits, **default[0].options, **_timed(w, default, ref)}
    ]
    rows[0].pop("DOT_PRECISION", None)
    for splits, block_n, stages, chunk, warps, maxnreg in itertools.product(
        own.splits, own.block_n, own.stages, own.chunks, own.warps, own.maxnreg
    ):
        opts = {"BLOCK_N": block_n, "num_stages": stages, "CHUNK_TILES": chunk, "num_warps": warps}
        if maxnreg:  # a register cap (0: the compiler's choice) lets more programs share an SM
            opts["maxnreg"] = maxnreg
        try:
            rows.append(
                {"splits": splits, **opts, **_timed(w, one_pass_launches(w, splits, opts), ref)}
            )
        except Exception as e:  # e.g. out of shared memory: skip the variant, say why
            rows.append({"splits": splits, **opts, "error": repr(e)[:120]})
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    return {
        "default_us": rows[0].get("us"),
        "one_pass_best": ok[: own.top],
        "errors": [r for r in rows if "error" in r][:4],
    }


def _timed(w: Workload, launches: list, ref: torch.Tensor) -> dict[str, Any]:
    run_all(launches)
    _sync(w)
    err = (w.one_pass_out.float() - ref.float()).abs().max().item()
    us = median_us_clean_l2(lambda: run_all(launches), w.q.device.type, True)
    gbps = (w.prefix_bytes + w.suffix_bytes) / us / 1e3
    return {"us": round(us, 1), "gb_s": round(gbps), "err": err}


def _sync(w: Workload) -> None:
    if w.q.is_cuda:
        torch.cuda.synchronize()


def run_all(launches: list) -> None:
    for launch in launches:
        launch.run()


def _own_args() -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--degree", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--one-pass", action="store_true", help="sweep the one-pass decode kernel")
    ints = {"type": int, "nargs": "+"}
    ap.add_argument("--splits", **ints, default=[1, 2, 4], help="one pass: splits to try")
    ap.add_argument("--block-n", **ints, default=[32, 64, 128], help="one pass: key tiles")
    ap.add_argument("--stages", **ints, default=[2, 3, 4, 5, 6], help="one pass: pipeline depths")
    ap.add_argument("--chunks", **ints, default=[16, 32], help="one pass: CHUNK_TILES")
    ap.add_argument("--warps", **ints, default=[4], help="one pass: warps per program")
    ap.add_argument("--maxnreg", **ints, default=[0], help="one pass: register caps (0: none)")
    return ap.parse_known_args()


def _sweep_prefix(w: Workload, ref_p: torch.Tensor) -> list[dict]:
    rows = []
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
            rows.append({"splits": splits, **opts, "error": repr(e)[:120]})
            continue
        gbps = w.prefix_bytes / us / 1e3
        rows.append({"splits": splits, **opts, "us": round(us, 1), "gb_s": round(gbps), "err": err})
    return rows


def _sweep_suffix(w: Workload, ref_out: torch.Tensor) -> list[dict]:
    rows = []
    for block_n, warps, stages in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (2, 3, 4)):
        opts = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        try:
            launch = suffix_launch(w, opts)
            launch.run()
            torch.cuda.synchronize()
            err = (w.cascade_out.float() - ref_out.float()).abs().max().item()
            us = median_us(launch.run, "cuda", True)
        except Exception as e:
            rows.append({**opts, "error": repr(e)[:120]})
            continue
        gbps = w.suffix_bytes / us / 1e3
        rows.append({**opts, "us": round(us, 1), "gb_s": round(gbps), "err": err})
    return rows


def main() -> int:
    own, rest = _own_args()
    args = parse_args(rest)
    w = Workload(args, own.degree, own.prefix_len)
    point = {"degree": own.degree, "prefix_len": w.prefix_len, "requests": w.num_requests}
    if own.one_pass:
        print(json.dumps({"device": device_name(), **point, **sweep_one_pass(w, own)}, indent=1))
        return 0
    w.prefix_pass()
    w.suffix_pass()
    torch.cuda.synchronize()
    prefix_rows = _sweep_prefix(w, w.o_p.clone())
    suffix_rows = _sweep_suffix(w, w.cascade_out.clone())

    def best(rows: list[dict]) -> list[dict]:
        ok = [r for r in rows if "us" in r]
        return sorted(ok, key=lambda r: r["us"])[: own.top]

    report = {
        "device": torch.cuda.get_device_name(),
        **point,
        "prefix_best": best(prefix_rows),
        "suffix_best": best(suffix_rows),
        "errors": [r for r in prefix_rows + suffix_rows if "error" in r][:4],
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
