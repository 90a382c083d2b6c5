"""How fast the planner takes a job in (parse, validate, tokenize, group) and how much memory it needs.

Three ways, each size in a fresh process so peaks do not mix:
  inproc  the planner's ingest pipeline in one process, no Redis: the compute alone;
  grpc    a real redis-server and `prefixgrove serve planner`; the client streams the lines over
          gRPC and seals the job: what a user sees, and the planner process's own peak memory;
  http    the OpenAI files API with the `openai` SDK: a --file-mb input file uploaded and its
          content downloaded, then a batch whose output file is --file-mb (its results written
          into Redis as a worker writes them, 256 KiB lines, so no engine runs) downloaded: the
          planner's peak memory at each stage, which must not grow with the file.

The job: shared-prefix requests (a few hundred long documents, each asked many questions), made on
the fly so the benchmark itself holds no file. Prints one JSON line per run.

  python benchmarks/planner.py --requests 100000 1000000 --mode inproc grpc
  python benchmarks/planner.py --mode http --file-mb 1024
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
from contextlib import contextmanager
from dataclasses import dataclass
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

    ingestor = JobIngestor({MODEL: PromptTokenizer(MODEL, 2048)}, IngestSettings())
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
    plan = ingestor.plan()[MODEL]
    total_s = time.perf_counter() - start
    return {
        "mode": "inproc", "requests": n, "input_mb": round(input_bytes / 2**20, 1),
        "prompt_tokens": ingestor.prompt_tokens, "index_held_mb": round(ingestor.models[MODEL].index.nbytes / 2**20, 1),
        "ingest_s": round(ingest_s, 2), "group_s": round(total_s - ingest_s, 2),
        "requests_per_s": round(n / total_s), "groups": plan.num_groups, "units": len(plan.units),
        "prefix_tokens_saved": plan.prefix_tokens_saved,
        "baseline_rss_mb": round(base), "ingest_peak_rss_mb": round(ingest_peak),
        "peak_rss_mb": round(peak_rss_mb()),
        "peak_growth_mb": round(peak_rss_mb() - base),
    }  # fmt: skip


def run_grpc(n: int) -> dict[str, object]:
    with _served_planner() as served:
        client, pid = served.client, served.planner.pid
        job = client.create_job()
        base = rss_mb(pid)
        start = time.perf_counter()
        reply = client.add_lines(job.id, job_lines(n))
        ingest_s = time.perf_counter() - start
        sealed = client.seal(job.id)
        total_s = time.perf_counter() - start
        return {
            "mode": "grpc", "requests": n, "accepted": reply.accepted, "ingest_s": round(ingest_s, 2),
            "seal_s": round(total_s - ingest_s, 2), "requests_per_s": round(n / total_s),
            "groups_total": sealed.groups_total, "prefix_tokens_saved": sealed.prefix_tokens_saved,
            "planner_baseline_rss_mb": round(base), "planner_peak_rss_mb": round(peak_rss_mb(pid)),
            "planner_peak_growth_mb": round(peak_rss_mb(pid) - base),
        }  # fmt: skip


RESULT_LINE_KB = 256


def run_http(file_mb: int) -> dict[str, object]:
    """Peak memory of a planner serving the files API while a file of `file_mb` goes up and
    comes down, and while a batch's output file of that size comes down."""
    import openai
    from redis import Redis

    http_port = _free_port()
    with _served_planner("--http-port", str(http_port), data_dir=True) as served:
        pid, tmp = served.planner.pid, served.dir
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none")
        base = rss_mb(pid)
        stages: dict[str, object] = {"planner_baseline_rss_mb": round(base)}
        big = Path(tmp) / "input.jsonl"
        _write_input(big, file_mb)
        start = time.perf_counter()
        with big.open("rb") as handle:
            uploaded = client.files.create(file=handle, purpose="batch")
        stages["upload_s"] = round(time.perf_counter() - start, 1)
        stages["upload_peak_rss_mb"] = round(peak_rss_mb(pid))
        big.unlink()  # the planner's copy is what comes back
        start = time.perf_counter()
        got = _download(client, uploaded.id)
        stages["download_s"] = round(time.perf_counter() - start, 1)
        stages["download_peak_rss_mb"] = round(peak_rss_mb(pid))
        client.files.delete(uploaded.id)
        output_file = _answered_batch(client, Redis(port=served.redis_port), tmp, file_mb)
        stages["answered_batch_peak_rss_mb"] = round(peak_rss_mb(pid))
        start = time.perf_counter()
        output_mb = round(_download(client, output_file) / 2**20, 1)
        stages["output_download_s"] = round(time.perf_counter() - start, 1)
        stages["output_download_peak_rss_mb"] = round(peak_rss_mb(pid))
        return {"mode": "http", "file_mb": round(got / 2**20, 1), "output_mb": output_mb, **stages,
                "planner_peak_growth_mb": round(peak_rss_mb(pid) - base)}  # fmt: skip


@dataclass
class _Served:
    dir: str  # a temporary folder: Redis's, and the planner's --data-dir where asked
    redis_port: int
    planner: subprocess.Popen[bytes]
    client: PlannerClient  # of the planner's gRPC port, ready


@contextmanager
def _served_planner(*extra: str, data_dir: bool = False) -> Iterator[_Served]:
    """A redis-server and `prefixgrove serve planner` (one math thread, MODEL, `extra` flags; with
    `data_dir`, its --data-dir the temporary folder) whose gRPC channel is ready; kills both at the
    end."""
    from prefixgrove.planner.client import PlannerClient

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (scripts/ci/install-redis.sh)")
    with tempfile.TemporaryDirectory() as tmp:
        redis_port, planner_port = _free_port(), _free_port()
        redis = subprocess.Popen([binary, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        flags = [*extra, *(["--data-dir", tmp] if data_dir else [])]
        planner = subprocess.Popen(
            [sys.executable, "-m", "prefixgrove.cli", "serve", "planner", "--redis-url",
             f"redis://127.0.0.1:{redis_port}/0", "--host", "127.0.0.1", "--port", str(planner_port),
             *flags, "--model", MODEL, "--max-model-len", "2048"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            client = PlannerClient(f"127.0.0.1:{planner_port}")
            _wait_ready(client, planner, planner_port)
            yield _Served(tmp, redis_port, planner, client)
        finally:
            planner.kill()
            redis.kill()


def _write_input(path: Path, mb: int) -> None:
    with path.open("wb") as out:
        for i, line in enumerate(job_lines(10**9)):
            out.write(line + b"\n")
            if i % 1000 == 0 and out.tell() >= mb << 20:
                return


def _download(client: object, file_id: str) -> int:
    size = 0
    with client.files.with_streaming_response.content(file_id) as response:  # type: ignore[attr-defined]
        for chunk in response.iter_bytes(1 << 20):
            size += len(chunk)
    return size


def _answered_batch(client: object, r: object, tmp: str, mb: int) -> str:
    """A batch of (mb MiB / 256 KiB) requests, answered by a stand-in worker that writes a
    256 KiB line per request into Redis through the job store, as workers write. Returns its
    output file's id."""
    from prefixgrove.jobs.redis_store.queue import GroupQueue
    from prefixgrove.jobs.redis_store.schema import ResultRecord
    from prefixgrove.jobs.redis_store.store import JobStore

    n = max(1, (mb << 10) // RESULT_LINE_KB)
    path = Path(tmp) / "batch.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in job_lines(n)))
    with path.open("rb") as handle:
        input_file = client.files.create(file=handle, purpose="batch")  # type: ignore[attr-defined]
    batch = client.batches.create(  # type: ignore[attr-defined]
        input_file_id=input_file.id, endpoint="/v1/completions", completion_window="24h"
    )
    store, queue = JobStore(r), GroupQueue(r, MODEL, "stand-in", 600)  # type: ignore[arg-type]
    store.ensure_queue(MODEL)  # as a worker does at its start
    filler = "x" * (RESULT_LINE_KB * 1024 - 100)
    answered = 0
    while answered < n:
        for lease in queue.take(64, 1000):
            loaded = store.load_group(lease.job_id, lease.group_id)
            assert loaded is not None
            group, records = loaded
            results = [(i, ResultRecord(False, json.dumps({"custom_id": rec.custom_id, "text": filler})), 1)
                       for i, rec in zip(group.indices, records, strict=True)]  # fmt: skip
            store.write_results(lease.job_id, results)
            store.finish_group(lease.job_id, lease.group_id)
            queue.ack(lease)
            answered += len(results)
    while (done := client.batches.retrieve(batch.id)).status != "completed":  # type: ignore[attr-defined]
        time.sleep(0.2)
    return str(done.output_file_id)


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
    parser.add_argument(
        "--mode", nargs="+", choices=["inproc", "grpc", "http"], default=["inproc", "grpc"]
    )
    parser.add_argument("--file-mb", type=int, default=1024, help="http: the file sizes (MiB)")
    parser.add_argument("--one", nargs=2, metavar=("MODE", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        mode, n = args.one[0], int(args.one[1])
        runs = {"inproc": run_inproc, "grpc": run_grpc, "http": run_http}
        print(json.dumps(runs[mode](n)), flush=True)
        return
    for mode in args.mode:
        for n in [args.file_mb] if mode == "http" else args.requests:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run([sys.executable, __file__, "--one", mode, str(n)], check=True, env=env)


if __name__ == "__main__":
    main()
