"""benchmarks/attention_kernels.py runs end to end (tiny shapes, Triton's interpreter on the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_kernels.py"


def test_benchmark_reports_every_sweep_point_and_cascade_matches_plain(device) -> None:
    """Tiny shapes: on the GPU when there is one (CUDA graphs, bf16, the read ceiling beside each
    point), else in Triton's interpreter on the CPU."""
    on_gpu = device.type == "cuda"
    args = "--requests 8 --degrees 4 8 --prefix-lens 64 --own-tokens 16 --heads 8 --kv-heads 2"
    args += " --head-dim 64 --num-splits 2"
    args += " --device cuda --dtype bfloat16" if on_gpu else " --device cpu --dtype float16"
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
    for r in report["results"]:
        assert r["matches_plain"] and r["groups"] == 8 // r["degree"]
        assert r["cascade_kv_mb"] < r["plain_kv_mb"]
        if on_gpu:  # a kernel that reads more than the streaming read cannot be faster than it
            assert r["read_ceiling_us"] > 0
            assert 0 < r["one_pass_of_ceiling"] <= 1.2
            assert r["speedup_bound"] == pytest.approx(r["plain_us"] / r["read_ceiling_us"], 0.02)
        else:
            assert "read_ceiling_us" not in r


def test_read_ceiling_kernel_reads_every_element_it_claims(device) -> None:
    """The streaming read that bounds the attention benchmark really loads what it counts: its lane
    sums add up to the sum of exactly the elements it says it read (and not the ones past them)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from _read_ceiling import per_program_elements, stream_read
    finally:
        sys.path.remove(str(SCRIPT.parent))

    x = torch.arange(3 * 64 * 2 + 37, device=device).to(torch.float16)
    sums = stream_read(x, programs=3, block=64)
    read = 3 * per_program_elements(x.numel(), 3, 64)
    assert read == 3 * 128
    assert sums.shape == (3, 64)
    assert sums.sum().item() == x[:read].float().sum().item()
