"""A fault campaign: one job through Redis (AOF), planner replicas and faulty workers on CPU while
workers, planner replicas and Redis are killed with SIGKILL at seeded points and started again,
with poison requests that kill every worker that runs them. The downloaded files must answer every
custom_id exactly once, as `prefixgrove run` of the same file does (fault_verdict.py names the two
departures it counts apart), the poison requests failed alone, within the duration bound.

    python tests/faults/campaign.py --requests 10000 --workers 3 --planners 2 --seed 1 \\
        --duration-bound-s 3600

Prints one JSON object and exits 1 when an invariant does not hold. Planner replicas are killed
only once the upload is sealed: the client does not retry an interrupted upload on another replica.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Run as a script: the shared test helpers live one folder up.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from fault_job import FaultJob, build_job
from fault_schedule import KINDS, Kill, plan_kills
from fault_stack import FaultStack
from fault_verdict import judge
from services_testbed import MAX_MODEL_LEN, MODEL, service_env

from prefixgrove.planner.client import PlannerUnavailable
from prefixgrove_proto import planner_pb2 as pb

_POLL_S = 0.2
_ENDED = (pb.JOB_STATE_COMPLETED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)


@dataclass
class Run:
    """What happened to the job: its id, the kills fired, and the seconds from submit to files."""

    job_id: str = ""
    state: str = "not submitted"
    kills: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    wall_s: float = 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests", type=int, default=600, help="lines in the job, poison included"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--planners", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="the kill plan")
    parser.add_argument(
        "--job-seed", type=int, default=0, help="poison places (its seeds share one reference)"
    )
    parser.add_argument(
        "--duration-bound-s",
        type=float,
        default=1800.0,
        help="submit to files; over is a violation",
    )
    parser.add_argument("--poison", type=int, default=2, help="poison requests in the job")
    parser.add_argument("--worker-kills", type=int, default=2)
    parser.add_argument("--planner-kills", type=int, default=1)
    parser.add_argument("--redis-kills", type=int, default=1)
    parser.add_argument("--workdir", type=Path, help="logs and files (default: a new temp folder)")
    parser.add_argument(
        "--reference-cache", type=Path, help="`prefixgrove run`'s files by job content, kept"
    )
    return parser.parse_args(argv)


def reference(job: Path, cache: Path | None, workdir: Path) -> tuple[Path, Path]:
    """The output and error files of `prefixgrove run` on `job`, from the cache when it has them."""
    digest = hashlib.sha256(job.read_bytes()).hexdigest()[:16]
    home = (cache or workdir) / f"reference-{digest}"
    home.parent.mkdir(parents=True, exist_ok=True)
    files = (home / "local.jsonl", home / "local.errors.jsonl")
    if home.is_dir():
        return files
    partial = Path(tempfile.mkdtemp(dir=home.parent, prefix=".reference-"))
    args = ["run", str(job), "-o", str(partial / files[0].name), "--errors",
            str(partial / files[1].name), "--model", MODEL, "--device", "cpu", "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--json"]  # fmt: skip
    # one math thread, like the workers: torch's default threads on busy cores run far slower
    run = subprocess.run([sys.executable, "-m", "prefixgrove.cli", *args], env=service_env(),
                         capture_output=True, text=True)  # fmt: skip
    if run.returncode != 0:
        raise RuntimeError(f"prefixgrove run failed: {run.stderr[-3000:]}")
    partial.rename(home)  # whole or not at all: an interrupted run leaves no cache entry
    return files


def fire(stack: FaultStack, kill: Kill) -> bool:
    """Fires `kill` on its target, or on the next one up when it is down; False if none is up."""
    if kill.kind == "redis":
        stack.kill_redis(kill.down_s)
        return True
    slots = stack.workers if kill.kind == "worker" else stack.planners
    for step in range(len(slots)):
        index = (kill.target + step) % len(slots)
        if slots[index].back_at is None:
            killer = stack.kill_worker if kill.kind == "worker" else stack.kill_planner
            killer(index, kill.down_s)
            return True
    return False


def run_job(stack: FaultStack, job: FaultJob, kills: list[Kill], deadline: float, run: Run) -> None:
    """Submits the job, then fires each kill once its mark is reached, until the job ends or the
    deadline passes."""
    started = time.monotonic()
    # no deadline: nothing is killed before the seal, and a busy machine makes a slow planner
    run.job_id = stack.call("submit", lambda c: c.submit_file(job.path), timeout_s=None).id
    pending = list(kills)
    while time.monotonic() < deadline:
        stack.supervise()
        try:
            got = stack.call("status", lambda c: c.get(run.job_id))
        except PlannerUnavailable:
            time.sleep(_POLL_S)
            continue
        run.state = pb.JobState.Name(got.state)
        if got.state in _ENDED:
            return
        counts = got.request_counts
        progress = (counts.completed + counts.failed) / max(counts.total, 1)
        while pending and pending[0].mark <= progress:
            kill = pending.pop(0)
            fired = fire(stack, kill)
            run.kills[kill.kind] += fired
            print(f"+{time.monotonic() - started:.1f} s, {progress:.3f} answered: kill "
                  f"{kill.kind} {kill.target}, down {kill.down_s} s{'' if fired else ': none up'}",
                  file=sys.stderr)  # fmt: skip
        time.sleep(_POLL_S)


def download(stack: FaultStack, job_id: str, workdir: Path, deadline: float) -> tuple[Path, Path]:
    files = (workdir / "out.jsonl", workdir / "out.errors.jsonl")
    while True:
        stack.supervise()
        try:
            stack.call("results", lambda c: c.write_results(job_id, *files))
            return files
        except PlannerUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(_POLL_S)


def campaign(args: argparse.Namespace, workdir: Path) -> dict:
    job = build_job(workdir / "in.jsonl", args.requests, args.poison, args.job_seed)
    ref = reference(job.path, args.reference_cache, workdir)
    counts = {"worker": args.worker_kills, "planner": args.planner_kills, "redis": args.redis_kills}
    kills = plan_kills(args.seed, counts, {"worker": args.workers, "planner": args.planners})
    stack = FaultStack.start(workdir, args.planners, args.workers)
    run = Run()
    try:
        start = time.monotonic()
        deadline = start + args.duration_bound_s
        run_job(stack, job, kills, deadline, run)
        finished = run.state == "JOB_STATE_COMPLETED"
        # the download gets a little time of its own past the bound, so a late job is still judged
        got = download(stack, run.job_id, workdir, deadline + 120) if finished else None
        run.wall_s = round(time.monotonic() - start, 1)
    finally:
        stack.stop()
    report = {"requests": args.requests, "workers": args.workers, "planners": args.planners,
              "seed": args.seed, "job_seed": args.job_seed, "poison": len(job.poison_ids),
              "state": run.state, "kills": run.kills, "kills_planned": len(kills),
              "self_deaths": stack.self_deaths, "wall_s": run.wall_s,
              "req_per_s": round(args.requests / run.wall_s, 1) if run.wall_s else 0.0,
              "bound_s": args.duration_bound_s,
              "within_bound": finished and run.wall_s <= args.duration_bound_s}  # fmt: skip
    verdict = judge(got, ref, job.poison_ids, run.kills["worker"]) if got else None
    if verdict is not None:
        report.update(asdict(verdict))
    report["ok"] = verdict is not None and verdict.ok and report["within_bound"]
    return report


def main() -> None:
    args = parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fault-campaign-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = campaign(args, workdir)
    if not report["ok"]:
        report["logs"] = str(workdir)  # kept for whoever reads the report
    elif args.workdir is None:
        shutil.rmtree(workdir)
    print(json.dumps(report))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
