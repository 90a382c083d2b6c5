"""benchmarks/services.py runs end to end on the CPU (the tiny model, a real redis-server, planner and
worker): every request answered through the deployed path and by the engine, and the report adds up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from services_testbed import need_redis

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "services.py"
TINY = ("--model tiny-random-llama --device cpu --vocab 256 --groups 6 --warm-groups 1 --per-group 4 "
        "--prefix-len 48 --suffix-len 8 --output-len 4 --requests 8 --prompt-len 24 "
        "--no-sharing-output-len 4")  # fmt: skip


def test_the_services_benchmark_reports_both_paths_for_every_shape() -> None:
    redis_server = need_redis()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [*TINY.split(), "--shapes", "canonical,no-sharing", "--redis-server", redis_server]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["shape"] for r in reports] == ["canonical", "no-sharing"]
    for report in reports:
        services, engine = report["services"], report["engine"]
        assert report["requests"] == (24 if report["shape"] == "canonical" else 8)
        assert sum(services["worker_requests"]) == report["requests"]
        assert (
            0 < services["upload_and_plan_s"] <= services["first_result_s"] <= services["seconds"]
        )
        assert services["run_s"] >= 0 and engine["requests_per_s"] > 0
        assert set(services["worker_loop_s"][0]) == {"idle", "lease", "step", "write"}
        assert report["ratio"] == pytest.approx(
            services["requests_per_s"] / engine["requests_per_s"], abs=0.002
        )
