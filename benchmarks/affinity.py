"""Prefix-affine leasing across jobs, with it and without, side by side in one run: two workers and a
planner on a redis-server of their own (services.py's stack), then three jobs submitted `--delay-s`
apart that share one system prompt and the same documents, each job asking its own questions about
every document (a group per document and job). Without affinity the later jobs' groups land on
either worker, and one that never ran the document prefills it again; with it, each group goes to
the worker that holds its document.

Reports, per mode (`affinity`, `no_affinity`):
  prefill_tokens    prompt tokens the workers' engines computed (their prompt_tokens_computed)
  reused_tokens     prompt tokens taken from a cached or shared prefix instead
  seconds           first submission to the last answer of the three jobs
  requests_per_s    the three jobs' requests over that span (mostly the delays between them)
  job_requests_per_s  the jobs' requests over the sum of their own seconds: the rate while a job
                    is in the system, which the span's delays do not dilute
  jobs              per job: seconds from its submission to its last answer, and requests/s
  worker_requests   requests each worker answered (the share of the work each took)
  groups_sent       groups sent to the worker holding their prefix
and across the modes `prefill_ratio` (no_affinity / affinity), `throughput_ratio` and
`job_throughput_ratio` (affinity / no_affinity, over the span and over the jobs' own seconds) and
`job_seconds_ratio` (per job, affinity / no_affinity: over 1, the job waited longer with
affinity), which is how fairness across jobs is measured. `documents_once` is the prefill of
perfect placement: each worker's system prompt, each document once, and every request's own
tokens, which start at its group prefix's last whole KV block (a group shares whole blocks, so the
document's tokens past its last whole block are computed per request, in both modes).

  cd benchmarks && python3 affinity.py             # the issue's shape, two GPUs
  python3 affinity.py --gpus 1 --worker-arg=--gpu-memory-utilization=0.42   # both on one GPU
  python3 benchmarks/affinity.py --model tiny-random-llama --device cpu --vocab 256 --delay-s 0.5 \\
      --system-len 32 --documents 8 --document-len 128 --questions 2 --question-len 8 \\
      --output-len 2 --max-groups-in-flight 2
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from services import Stack, progress, start_stack, worker_metrics, write_job

from _common import ROOT, device_name, emit

MODES = {"affinity": "true", "no_affinity": "false"}
_POLL_S = 0.05


def job_prompts(args: argparse.Namespace, job: int, seed: int = 0) -> list[list[int]]:
    """One job: for every document, `questions` prompts of the system prompt, the document and a
    question of the job's own. The system prompt and documents are the same in every job, their
    order the job's own (as two jobs over one corpus list it), so that no fixed order of leasing
    puts each document on the same worker by chance."""
    shared = np.random.default_rng(seed)
    system = shared.integers(0, args.vocab, args.system_len)
    documents = [shared.integers(0, args.vocab, args.document_len) for _ in range(args.documents)]
    own = np.random.default_rng([seed, job])
    return [
        [*system.tolist(), *documents[d].tolist(),
         *own.integers(0, args.vocab, args.question_len).tolist()]
        for d in own.permutation(args.documents)
        for _ in range(args.questions)
    ]  # fmt: skip


def run_job(port: int, path: Path, total: int, delay_s: float, t0: float, out: dict,
            metrics_ports: list[int]) -> None:  # fmt: skip
    """Submits the job `delay_s` after t0 and notes when it was submitted and when its last
    request was answered, with the workers' counters at both."""
    from prefixgrove.planner.client import PlannerClient

    time.sleep(max(t0 + delay_s - time.monotonic(), 0.0))
    client = PlannerClient(f"127.0.0.1:{port}")
    out["before"] = [worker_metrics(p) for p in metrics_ports]
    out["submitted"] = time.monotonic()
    job_id = client.submit_file(path).id
    while True:
        counts = client.get(job_id).request_counts
        if counts.completed + counts.failed >= total:
            break
        time.sleep(_POLL_S)
    out.update(done=time.monotonic(), completed=counts.completed, failed=counts.failed)
    out["after"] = [worker_metrics(p) for p in metrics_ports]
    client.close()


def run_jobs(stack: Stack, jobs: list[Path], totals: list[int], delay_s: float) -> list[dict]:
    """All jobs, job i submitted i * delay_s after the first; each one's timeline."""
    t0 = time.monotonic()
    records: list[dict] = [{} for _ in jobs]
    threads = [
        threading.Thread(target=run_job, daemon=True,
                         args=(stack.planner_port, path, total, i * delay_s, t0, record,
                               stack.worker_metrics))
        for i, (path, total, record) in enumerate(zip(jobs, totals, records, strict=True))
    ]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for record, total in zip(records, totals, strict=True):
        if record.get("completed") != total:
            raise SystemExit(f"a job answered {record.get('completed')} of {total} requests")
    return records


def run_mode(mode: str, args: argparse.Namespace, d: Path) -> dict[str, Any]:
    """Starts the stack with affinity on or off, warms it up, and runs the three jobs."""
    stack_args = argparse.Namespace(
        redis_server=args.redis_server, model=args.model, device=args.device, tensor_parallel_size=1,
        gpus=args.gpus,
        worker_arg=[*args.worker_arg, "--prefix-affinity", MODES[mode],
                    "--max-groups-in-flight", str(args.max_groups_in_flight)],
    )  # fmt: skip
    progress(f"{mode}: starting redis-server, a planner and {args.workers} workers")
    stack = start_stack(d, stack_args, args.workers)
    try:
        warm = write_job(d / "warm.jsonl", job_prompts(args, 0, seed=1), args.output_len)
        run_jobs(stack, [warm], [args.documents * args.questions], 0.0)
        before = [worker_metrics(p) for p in stack.worker_metrics]
        paths = [write_job(d / f"job{j}.jsonl", job_prompts(args, j), args.output_len)
                 for j in range(args.jobs)]  # fmt: skip
        progress(f"{mode}: {args.jobs} jobs of {args.documents * args.questions} requests, "
                 f"{args.delay_s}s apart")  # fmt: skip
        records = run_jobs(stack, paths, [args.documents * args.questions] * args.jobs,
                           args.delay_s)  # fmt: skip
        after = [worker_metrics(p) for p in stack.worker_metrics]
    finally:
        stack.stop()
    return mode_report(records, list(zip(before, after, strict=True)))


def _delta(metrics: list[tuple[dict, dict]], name: str) -> list[float]:
    return [after.get(name, 0.0) - before.get(name, 0.0) for before, after in metrics]


def documents_once(args: argparse.Namespace) -> int:
    """The prefill of perfect placement (module docstring): no worker computes a document twice."""
    shared = args.system_len + args.document_len
    own = shared % args.block_size + args.question_len  # past the group prefix's last whole block
    requests = args.jobs * args.documents * args.questions
    return args.workers * args.system_len + args.documents * args.document_len + requests * own


def mode_report(records: list[dict], metrics: list[tuple[dict, dict]]) -> dict[str, Any]:
    start = min(r["submitted"] for r in records)
    seconds = max(r["done"] for r in records) - start
    requests = sum(r["completed"] for r in records)
    job_seconds = sum(r["done"] - r["submitted"] for r in records)
    return {
        "prefill_tokens": int(sum(_delta(metrics, "prompt_tokens_computed_total"))),
        "reused_tokens": int(sum(_delta(metrics, "prefix_tokens_reused_total"))),
        "seconds": round(seconds, 2),
        "requests_per_s": round(requests / seconds, 2),
        "job_requests_per_s": round(requests / job_seconds, 2),
        "jobs": [job_report(r) for r in records],
        "worker_requests": [int(n) for n in _delta(metrics, "requests_done_total")],
        "groups_sent": int(sum(_delta(metrics, "groups_sent_total"))),
    }


def job_report(record: dict) -> dict[str, Any]:
    """One job's seconds and rate, and what the workers' counters moved by over its span (the
    counters of jobs that overlap it too, where any do): prefill, groups sent to their prefix's
    holder, and the mean seconds a group waited to be leased and took to run."""
    seconds = record["done"] - record["submitted"]
    moved = list(zip(record["before"], record["after"], strict=True))

    def mean(name: str) -> float:
        count = sum(_delta(moved, f"{name}_count"))
        return round(sum(_delta(moved, f"{name}_sum")) / count, 3) if count else 0.0

    return {
        "seconds": round(seconds, 2),
        "requests_per_s": round(record["completed"] / seconds, 2),
        "prefill_tokens": int(sum(_delta(moved, "prompt_tokens_computed_total"))),
        "groups_sent": int(sum(_delta(moved, "groups_sent_total"))),
        "queue_wait_s": mean("group_queue_wait_seconds"),
        "group_run_s": mean("group_run_seconds"),
    }


def compare(reports: dict[str, dict]) -> dict[str, Any]:
    on, off = reports["affinity"], reports["no_affinity"]
    return {
        "prefill_ratio": round(off["prefill_tokens"] / max(on["prefill_tokens"], 1), 3),
        "throughput_ratio": round(on["requests_per_s"] / off["requests_per_s"], 3),
        "job_throughput_ratio": round(on["job_requests_per_s"] / off["job_requests_per_s"], 3),
        "job_seconds_ratio": [round(a["seconds"] / b["seconds"], 3)
                              for a, b in zip(on["jobs"], off["jobs"], strict=True)],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b-random")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=128256, help="prompt token ids are below it")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPUs the workers take in turn (default: one a worker); fewer share them",
    )
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--delay-s", type=float, default=10.0, help="between two jobs' submissions")
    ap.add_argument("--system-len", type=int, default=2000, help="the system prompt's tokens")
    ap.add_argument("--documents", type=int, default=32)
    ap.add_argument("--document-len", type=int, default=1000)
    ap.add_argument("--questions", type=int, default=16, help="a job's questions per document")
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16, help="the workers' KV block size")
    ap.add_argument(
        "--max-groups-in-flight",
        type=int,
        default=8,
        help="a worker's groups at once: fewer than a job's, so both workers share it",
    )
    ap.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    ap.add_argument("--worker-arg", action="append", default=[], help="a flag for every worker")
    args = ap.parse_args()
    reports = {}
    for mode in MODES:
        with tempfile.TemporaryDirectory(prefix=f"affinity-{mode}-") as tmp:
            reports[mode] = run_mode(mode, args, Path(tmp))
    emit({"benchmark": "affinity", "device": device_name(), "workers": args.workers,
          "jobs": args.jobs, "requests_per_job": args.documents * args.questions,
          "delay_s": args.delay_s, "worker_args": args.worker_arg, "gpus": args.gpus or args.workers,
          "documents_once": documents_once(args), **reports, **compare(reports)})  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    main()
