"""benchmarks/attention_kernels.py runs end to end (tiny shapes, Triton's interpreter on the CPU),
on caches in the queries' dtype and in FP8 as the engine keeps them."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_kernels.py"
TINY = "--requests 8 --degrees 4 8 --prefix-lens 64 --own-tokens 16 --heads 8 --kv-heads 2"
TINY += " --head-dim 64 --num-splits 2"


def benchmark_module(name: str) -> ModuleType:
    """A module of benchmarks/, imported as the scripts import each other (from their folder)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPT.parent))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_benchmark_reports_every_sweep_point_and_cascade_matches_plain(
    device, kv_cache_dtype: str
) -> None:
    """Tiny shapes: on the GPU when there is one (CUDA graphs, bf16, the read ceiling beside each
    point), else in Triton's interpreter on the CPU; every kernel reads the cache of
    --kv-cache-dtype, and every point names its element type."""
    on_gpu = device.type == "cuda"
    dtype = "bfloat16" if on_gpu else "float16"
    args = f"{TINY} --device {device.type} --dtype {dtype} --kv-cache-dtype {kv_cache_dtype}"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if not on_gpu:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args.split()],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    points = [(r["degree"], r["prefix_len"]) for r in report["results"]]
    assert points == [(4, 64), (8, 64)]
    assert report["config"]["kv_cache_dtype"] == kv_cache_dtype
    for r in report["results"]:
        assert r["kv_dtype"] == ("float8_e4m3fn" if kv_cache_dtype == "fp8" else dtype)
        assert r["matches_plain"] and r["groups"] == 8 // r["degree"]
        assert r["cascade_kv_mb"] < r["plain_kv_mb"]
        if on_gpu:  # a kernel that reads more than the streaming read cannot be faster than it
            assert r["read_ceiling_us"] > 0
            assert 0 < r["one_pass_of_ceiling"] <= 1.2
            assert r["speedup_bound"] == pytest.approx(r["plain_us"] / r["read_ceiling_us"], 0.02)
        else:
            assert "read_ceiling_us" not in r


def test_fp8_workload_holds_the_same_values_as_codes_and_counts_one_byte_each() -> None:
    """--kv-cache-dtype fp8 quantizes the very values of the fp16 sweep point (same seed) to e4m3
    under the engine's scale, keeps everything else, and counts half the bytes, so the GB/s and the
    read ceiling are those of what the kernels really read."""
    from prefixgrove_kernels.reference_math import quantize_kv

    bench = benchmark_module("attention_kernels")
    points = {}
    for kv_cache_dtype in ("auto", "fp8"):
        args = bench.parse_args(
            f"{TINY} --device cpu --dtype float16 --kv-cache-dtype {kv_cache_dtype}".split()
        )
        torch.manual_seed(0)
        points[kv_cache_dtype] = bench.Workload(args, degree=4, prefix_len=64)
    plain, fp8 = points["auto"], points["fp8"]
    assert plain.k_scale is None and plain.v_scale is None
    for cache, scale, values in ((fp8.k_cache, fp8.k_scale, plain.k_cache),
                                 (fp8.v_cache, fp8.v_scale, plain.v_cache)):  # fmt: skip
        assert scale.dtype == torch.float32 and scale.tolist() == [bench.ENGINE_FP8_KV_SCALE]
        assert cache.dtype == torch.float8_e4m3fn
        assert torch.equal(cache.view(torch.uint8), quantize_kv(values, scale).view(torch.uint8))
    assert torch.equal(fp8.q, plain.q) and torch.equal(fp8.block_tables, plain.block_tables)
    for name in ("plain_bytes", "prefix_bytes", "suffix_bytes"):
        assert 2 * getattr(fp8, name) == getattr(plain, name), name


def test_fp8_workload_scale_is_the_engines() -> None:
    """The benchmark's FP8 caches carry the scale the engine gives each FP8 cache it allocates."""
    from prefixgrove.engine.attention import kv_cache

    bench = benchmark_module("attention_kernels")
    ((k, v),) = kv_cache.allocate(1, (1, 8, 1, 32), torch.float16, "fp8", torch.device("cpu"))
    assert isinstance(k, kv_cache.Fp8Cache) and isinstance(v, kv_cache.Fp8Cache)
    assert k.scale.tolist() == v.scale.tolist() == [bench.ENGINE_FP8_KV_SCALE]


def test_read_ceiling_kernel_reads_every_element_it_claims(device) -> None:
    """The streaming read that bounds the attention benchmark really loads what it counts: its lane
    sums add up to the sum of exactly the elements it says it read (and not the ones past them)."""
    read_ceiling = benchmark_module("_read_ceiling")
    per_program_elements, stream_read = read_ceiling.per_program_elements, read_ceiling.stream_read

    x = torch.arange(3 * 64 * 2 + 37, device=device).to(torch.float16)
    sums = stream_read(x, programs=3, block=64)
    read = 3 * per_program_elements(x.numel(), 3, 64)
    assert read == 3 * 128
    assert sums.shape == (3, 64)
    assert sums.sum().item() == x[:read].float().sum().item()
