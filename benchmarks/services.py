"""The deployed path against the engine, side by side in one run: a job submitted through the CLI to a
redis-server, a planner and N workers (one per GPU, or one per
--tensor-parallel-size GPUs) on this machine, then `LLM.generate` on the same
prompts with the same batch limits the workers take by default. Reports requests/s of both, their
ratio, and where the deployed path's wall time goes:

  upload_and_plan_s   CLI start to the job sealed (read and stream the file, validate, group, queue)
  grouping_s          the planner's share of it spent grouping (from its log)
  first_lease_s       CLI start to the first group held by a worker
  first_result_s      CLI start to the first result in Redis
  run_s               first lease to the last result
  download_tail_s     last result to the CLI's exit (what the streamed download had left)
  worker_loop_s       per worker, seconds of its loop taking/loading groups, in the engine, writing

Shapes: `canonical` (DESIGN.md: groups of 16 sharing a 2,000-token prefix, 200 own tokens, 100 out)
and `no-sharing` (throughput.py's: 1,000 random 1,000-token prompts, 200 out). Each worker first runs
a small job of the same shape, so kernels are compiled before the clock starts, as the engine's
warm-up does. Prints one JSON line per shape.

  cd benchmarks && python3 services.py --shapes canonical --groups 400
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from _common import (
    ROOT,
    device_name,
    emit,
    greedy_params,
    random_prompts,
    shared_prefix_prompts,
    timed,
)

SHAPES = ("canonical", "no-sharing")
_POLL_S = 0.1


@dataclass
class Shape:
    name: str
    prompts: list[list[int]]
    warm: list[list[int]]
    output_len: int


def make_shape(name: str, args: argparse.Namespace) -> Shape:
    if name == "canonical":

        def job(groups: int, seed: int) -> list[list[int]]:
            return shared_prefix_prompts(groups, args.per_group, args.prefix_len, args.suffix_len,
                                         args.vocab, seed)  # fmt: skip

        return Shape(name, job(args.groups, 0), job(args.warm_groups, 1), args.output_len)
    if name == "no-sharing":
        prompts = random_prompts(args.requests, args.prompt_len, args.vocab, 0)
        warm = random_prompts(max(args.requests // 4, 1), args.prompt_len, args.vocab, 1)
        return Shape(name, prompts, warm, args.no_sharing_output_len)
    raise SystemExit(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")


def write_job(path: Path, prompts: list[list[int]], output_len: int) -> Path:
    with path.open("w") as f:
        for i, prompt in enumerate(prompts):
            body = {"prompt": prompt, "max_tokens": output_len,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
            f.write(json.dumps(line) + "\n")
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefixgrove.cli", *args]


# --- the services -------------------------------------------------------------------------------
@dataclass
class Stack:
    dir: Path
    redis_url: str
    planner_port: int
    worker_metrics: list[int]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def start_stack(d: Path, args: argparse.Namespace, gpus: int) -> Stack:
    redis_port, planner_port = free_port(), free_port()
    stack = Stack(d, f"redis://127.0.0.1:{redis_port}/0", planner_port,
                  [free_port() for _ in range(gpus)])  # fmt: skip

    def spawn(name: str, cmd: list[str], **env: str) -> None:
        log = (d / f"{name}.log").open("w")
        stack.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, **env}))  # fmt: skip

    spawn("redis", [args.redis_server, "--port", str(redis_port), "--save", "", "--appendonly", "no",
                    "--dir", str(d)])  # fmt: skip
    wait_port(redis_port, 30, stack)
    spawn("planner", cli("serve", "planner", "--redis-url", stack.redis_url, "--port",
                         str(planner_port), "--model", args.model))  # fmt: skip
    tp = args.tensor_parallel_size
    shared = getattr(args, "gpus", None)  # fewer GPUs than the workers need: they take them in turn
    for worker, metrics in enumerate(stack.worker_metrics):
        # a worker's tp GPUs; the engine starts a process per GPU
        ids = (worker * tp + rank for rank in range(tp))
        gpu_ids = ",".join(str(i % shared if shared else i) for i in ids)
        spawn(f"worker{worker}", cli("serve", "worker", "--redis-url", stack.redis_url, "--model", args.model,
                                     "--device", args.device, "--consumer", f"w{worker}", "--metrics-port",
                                     str(metrics), "--tensor-parallel-size", str(tp), *args.worker_arg),
              CUDA_VISIBLE_DEVICES=gpu_ids)  # fmt: skip
    wait_port(planner_port, 120, stack)
    for metrics in stack.worker_metrics:
        wait_port(metrics, 600, stack)  # the worker serves metrics once its engine is up
    return stack


def wait_port(port: int, timeout: float, stack: Stack) -> None:
    """Waits for a listener on `port`; a process of the stack that exits meanwhile ends the run."""
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in stack.procs):
            stack.stop()
            raise SystemExit(f"a process exited while starting: see the logs in {stack.dir}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise SystemExit(f"nothing listens on port {port} after {timeout:.0f}s")


def worker_metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("prefixgrove_worker_"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'model="[^"]*",?', "", name).replace("{}", "")  # one model a worker
            out[name.removeprefix("prefixgrove_worker_")] = float(value)
    return out


# --- one timed submission -----------------------------------------------------------------------
@dataclass
class Timeline:
    start: float
    job_id: str = ""
    sealed: float | None = None
    first_lease: float | None = None
    first_result: float | None = None
    last_result: float | None = None
    end: float | None = None
    done_by_worker: list[float] = field(default_factory=list)


def watch(stack: Stack, total: int, timeline: Timeline, stop: threading.Event) -> None:
    """Polls the planner and the workers' metrics: when the first group was held, the first and
    the last result written, and when each worker answered its last request."""
    from prefixgrove.planner.client import PlannerClient

    client = PlannerClient(f"127.0.0.1:{stack.planner_port}")
    last_done = [-1.0] * len(stack.worker_metrics)
    done_before = [
        worker_metrics(port).get("groups_done_total", 0) for port in stack.worker_metrics
    ]
    timeline.done_by_worker = [0.0] * len(stack.worker_metrics)
    while True:
        # one last poll after the stop: a small job can be answered whole between two polls; what
        # that poll sees happened by the end
        stopped = stop.wait(_POLL_S)
        now = min(time.monotonic(), timeline.end) if stopped and timeline.end else time.monotonic()
        for i, port in enumerate(stack.worker_metrics):
            m = worker_metrics(port)
            # a group held, or one finished since the last poll (a small one may fit between)
            held = m.get("groups_leased", 0) > 0 or m.get("groups_done_total", 0) > done_before[i]
            if timeline.first_lease is None and held:
                timeline.first_lease = now
            if m.get("requests_done_total", 0) != last_done[i]:
                last_done[i] = m.get("requests_done_total", 0)
                timeline.done_by_worker[i] = now
        if timeline.job_id:
            counts = client.get(timeline.job_id).request_counts
            answered = counts.completed + counts.failed
            if answered and timeline.first_result is None:
                timeline.first_result = now
            if answered >= total and timeline.last_result is None:
                timeline.last_result = now
        if stopped:
            return


def submit(stack: Stack, job: Path, out: Path, total: int) -> tuple[float, Timeline]:
    """`prefixgrove submit --wait` of the job: its wall time and what happened meanwhile."""
    timeline = Timeline(time.monotonic())
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stack, total, timeline, stop), daemon=True)
    watcher.start()
    cmd = cli("submit", str(job), "--planner", f"127.0.0.1:{stack.planner_port}", "--wait",
              "-o", str(out), "--json")  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if timeline.sealed is None:  # the first line: the job, sealed
            timeline.sealed = time.monotonic()
            timeline.job_id = json.loads(line)["id"]
    if proc.wait() != 0:
        raise SystemExit(f"submit failed: {' '.join(cmd)}")
    timeline.end = time.monotonic()
    stop.set()
    watcher.join()
    return timeline.end - timeline.start, timeline


def grouping_seconds(planner_log: Path) -> float:
    found = re.findall(r"grouped[^\n]* in ([0-9.]+)s", planner_log.read_text())
    return float(found[-1]) if found else float("nan")


def run_services(shape: Shape, args: argparse.Namespace, d: Path) -> dict[str, Any]:
    gpus = args.workers or max(torch.cuda.device_count() // args.tensor_parallel_size, 1)
    progress(f"{shape.name}: starting redis-server, a planner and {gpus} workers")
    stack = start_stack(d, args, gpus)
    try:
        progress(f"{shape.name}: warm-up job of {len(shape.warm)} requests")
        warm = write_job(d / "warm.jsonl", shape.warm, 16)
        submit(stack, warm, d / "warm.out.jsonl", len(shape.warm))
        progress(f"{shape.name}: the timed job, {len(shape.prompts)} requests")
        before = [worker_metrics(p) for p in stack.worker_metrics]
        job = write_job(d / "job.jsonl", shape.prompts, shape.output_len)
        seconds, t = submit(stack, job, d / "out.jsonl", len(shape.prompts))
        metrics = [
            (b, worker_metrics(p)) for b, p in zip(before, stack.worker_metrics, strict=True)
        ]
    finally:
        stack.stop()
    lines = sum(1 for _ in (d / "out.jsonl").open())
    if lines != len(shape.prompts):
        raise SystemExit(f"{lines} results for {len(shape.prompts)} requests")
    return services_report(shape, seconds, t, metrics, grouping_seconds(d / "planner.log"))


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _since(t: Timeline, moment: float | None) -> float | None:
    return None if moment is None else round(moment - t.start, 2)


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def services_report(
    shape: Shape, seconds: float, t: Timeline, metrics: list[tuple[dict, dict]], grouping_s: float
) -> dict[str, Any]:
    """`metrics`: each worker's metrics before and after the timed job."""
    phases = ("idle", "lease", "step", "write")
    loops = [
        {p: round(_delta(b, a, f'loop_seconds_total{{phase="{p}"}}'), 2) for p in phases}
        for b, a in metrics
    ]
    run = None
    if t.first_lease is not None and t.last_result is not None:
        run = round(t.last_result - t.first_lease, 2)
    tail = None
    if t.last_result is not None and t.end is not None:
        tail = round(t.end - t.last_result, 2)
    return {
        "workers": len(metrics),
        "seconds": round(seconds, 2),
        "requests_per_s": round(len(shape.prompts) / seconds, 2),
        "upload_and_plan_s": _since(t, t.sealed),
        "grouping_s": grouping_s,
        "first_lease_s": _since(t, t.first_lease),
        "first_result_s": _since(t, t.first_result),
        "run_s": run,
        "download_tail_s": tail,
        "worker_loop_s": loops,
        "worker_requests": [int(_delta(b, a, "requests_done_total")) for b, a in metrics],
        "worker_last_answer_s": [_since(t, w) for w in t.done_by_worker],
    }


# --- the engine, same prompts ------------------------------------------------------------------
def run_engine(shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    from prefixgrove import LLM

    progress(
        f"{shape.name}: LLM.generate on the same prompts (the engine's defaults, as the worker's)"
    )
    llm = LLM(args.model, device=args.device, tensor_parallel_size=args.tensor_parallel_size)
    limits = llm.config.scheduler
    llm.generate([{"prompt_token_ids": p} for p in shape.warm], greedy_params(16), use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in shape.prompts]
    _, seconds = timed(
        lambda: llm.generate(prompts, greedy_params(shape.output_len), use_tqdm=False)
    )
    return {"seconds": round(seconds, 2), "requests_per_s": round(len(shape.prompts) / seconds, 2),
            "max_num_seqs": limits.max_num_seqs,
            "max_num_batched_tokens": limits.max_num_batched_tokens}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="canonical")
    ap.add_argument("--model", default="llama-3.1-8b-random")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=128256, help="prompt token ids are below it")
    ap.add_argument("--groups", type=int, default=400, help="canonical: groups in the job")
    ap.add_argument("--warm-groups", type=int, default=40, help="canonical: groups warming up")
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--suffix-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--requests", type=int, default=1000, help="no-sharing: requests")
    ap.add_argument("--prompt-len", type=int, default=1000, help="no-sharing: prompt tokens")
    ap.add_argument("--no-sharing-output-len", type=int, default=200)
    ap.add_argument("--workers", type=int, default=0, help="default: one per GPU")
    ap.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per worker")
    ap.add_argument("--worker-arg", action="append", default=[], help="a flag for every worker")
    ap.add_argument("--no-engine", action="store_true", help="skip LLM.generate")
    args = ap.parse_args()
    for name in args.shapes.split(","):
        shape = make_shape(name, args)
        with tempfile.TemporaryDirectory(prefix=f"services-{name}-") as tmp:
            services = run_services(shape, args, Path(tmp))
        result = {"benchmark": "services", "shape": name, "device": device_name(),
                  "requests": len(shape.prompts), "worker_args": args.worker_arg,
                  "tensor_parallel_size": args.tensor_parallel_size,
                  "services": services}  # fmt: skip
        if not args.no_engine:
            engine = run_engine(shape, args)
            result["engine"] = engine
            result["ratio"] = round(services["requests_per_s"] / engine["requests_per_s"], 3)
            gc.collect()  # the engine's memory goes back before the next shape's workers start
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        emit(result)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    main()
