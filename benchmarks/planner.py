"""How fast the planner takes a job in (parse, validate, tokenize, group) and how much memory it needs.

Two ways, each size in a fresh process so peaks do not mix:
  inproc  the planner's ingest pipeline in one process, no Redis: the compute alone;
  grpc    a real redis-server and `prefixgrove serve planner`; the client streams the lines over
          gRPC and seals the job: what a user sees, and the planner process's own peak memory.

The job: shared-prefix requests (a few hundred long documents, each asked many questions), made on
the fly so the benchmark itself holds no file. Prints one JSON line per run.

  python benchmarks/planner.py --requests 100000 1000000 --mode inproc grpc
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixgrove.planner.client import PlannerClient

MODEL = "tiny-random-llama"
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


def job_lines(n: int, docs: int = 500, seed: int = 0) -> Iterator[bytes]:
    rng = random.Random(seed)
    documents = [f"Doc {d}: " + " ".join(rng.choice(WORDS) for _ in range(20)) for d in range(docs)]
    for i in range(n):
        body = {
            "prompt": f"{documents[i % docs]}\nQ{i}: continue.",
            "max_tokens": 16,
            "temperature": 0,
        }
        line = {
            "custom_id": f"request-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": body,
        }
        yield json.dumps(line).encode()


def _status_mb(pid: int | str, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def peak_rss_mb(pid: int | str = "self") -> float:
    return _status_mb(pid, "VmHWM")


def rss_mb(pid: int | str = "self") -> float:
    return _status_mb(pid, "VmRSS")


def run_inproc(n: int) -> dict[str, object]:
    from prefixgrove.jobs.ingest import JobIngestor
    from prefixgrove.jobs.tokenize import PromptTokenizer
    from prefixgrove.settings import IngestSettings

    ingestor = JobIngestor(PromptTokenizer(MODEL, 2048), IngestSettings())
    base = rss_mb()
    start = time.perf_counter()
    chunk: list[bytes] = []
    input_bytes = 0
    for line in job_lines(n):
        chunk.append(line)
        input_bytes += len(line) + 1
        if len(chunk) == 4096:
            ingestor.add(chunk)  # the planner writes each batch out (to Redis), keeps its index
            chunk = []
    ingestor.add(chunk)
    ingest_s = time.perf_counter() - start
    ingest_peak = peak_rss_mb()
    plan = ingestor.plan()
    total_s = time.perf_counter() - start
    return {
        "mode": "inproc", "requests": n, "input_mb": round(input_bytes / 2**20, 1),
        "prompt_tokens": ingestor.prompt_tokens, "index_held_mb": round(ingestor.index.nbytes / 2**20, 1),
        "ingest_s": round(ingest_s, 2), "group_s": round(total_s - ingest_s, 2),
        "requests_per_s": round(n / total_s), "groups": plan.num_groups, "units": len(plan.units),
        "prefix_tokens_saved": plan.prefix_tokens_saved,
        "baseline_rss_mb": round(base), "ingest_peak_rss_mb": round(ingest_peak),
        "peak_rss_mb": round(peak_rss_mb()),
        "peak_growth_mb": round(peak_rss_mb() - base),
    }  # fmt: skip


def run_grpc(n: int) -> dict[str, object]:
    from prefixgrove.planner.client import PlannerClient

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (scripts/ci/install-redis.sh)")
    with tempfile.TemporaryDirectory() as tmp:
        redis_port, planner_port = _free_port(), _free_port()
        redis = subprocess.Popen([binary, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        planner = subprocess.Popen(
            [sys.executable, "-m", "prefixgrove.cli", "serve", "planner", "--redis-url",
             f"redis://127.0.0.1:{redis_port}/0", "--host", "127.0.0.1", "--port", str(planner_port),
             "--model", MODEL, "--max-model-len", "2048"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            client = PlannerClient(f"127.0.0.1:{planner_port}")
            _wait_ready(client, planner, planner_port)
            job = client.create_job()
            base = rss_mb(planner.pid)
            start = time.perf_counter()
            reply = client.add_lines(job.id, job_lines(n))
            ingest_s = time.perf_counter() - start
            sealed = client.seal(job.id)
            total_s = time.perf_counter() - start
            return {
                "mode": "grpc", "requests": n, "accepted": reply.accepted, "ingest_s": round(ingest_s, 2),
                "seal_s": round(total_s - ingest_s, 2), "requests_per_s": round(n / total_s),
                "groups_total": sealed.groups_total, "prefix_tokens_saved": sealed.prefix_tokens_saved,
                "planner_baseline_rss_mb": round(base), "planner_peak_rss_mb": round(peak_rss_mb(planner.pid)),
                "planner_peak_growth_mb": round(peak_rss_mb(planner.pid) - base),
            }  # fmt: skip
        finally:
            planner.kill()
            redis.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(
    client: PlannerClient, planner: subprocess.Popen, port: int, timeout: float = 60.0
) -> None:
    """Waits until the planner's gRPC channel is ready, failing at once if the planner exits."""
    import grpc

    ready = grpc.channel_ready_future(client.channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if planner.poll() is not None:
            raise RuntimeError(f"the planner exited with code {planner.returncode}")
        try:
            ready.result(timeout=0.5)
            return
        except grpc.FutureTimeoutError:
            continue
    raise RuntimeError(f"the planner did not answer on port {port} within {timeout:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--mode", nargs="+", choices=["inproc", "grpc"], default=["inproc", "grpc"])
    parser.add_argument("--one", nargs=2, metavar=("MODE", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        mode, n = args.one[0], int(args.one[1])
        print(json.dumps(run_inproc(n) if mode == "inproc" else run_grpc(n)), flush=True)
        return
    for mode in args.mode:
        for n in args.requests:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run([sys.executable, __file__, "--one", mode, str(n)], check=True, env=env)


if __name__ == "__main__":
    main()
