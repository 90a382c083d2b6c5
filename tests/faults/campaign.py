"""A fault campaign: one job through Redis (AOF), planner replicas and faulty workers on CPU while
workers, planner replicas and Redis are killed with SIGKILL at seeded points and started again,
with poison requests that kill every worker that runs them; a client killed mid-upload before the
job is submitted again under its idempotency key, clients stalling uploads and watches, and Redis
refusing writes for lack of memory for a while. The downloaded files must answer every custom_id
exactly once, as `prefixgrove run` of the same file does (fault_verdict.py names the one departure
it counts apart), the poison requests failed alone, within the duration bound.

    python tests/faults/campaign.py --requests 10000 --workers 3 --planners 2 --seed 1 \\
        --duration-bound-s 3600

Prints one JSON object and exits 1 when an invariant does not hold. The job is submitted as a
Service's users submit, through one target naming every replica (`ipv4:A,B`): an `upload` kill
stops the replica taking the upload in the middle of it, and the client carries the upload on; a
`resubmit` has a first client (fault_client.py) send part of the input under the same idempotency
key and die first, so the submit finds that client's half-uploaded job.
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
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

# Run as a script: the shared test helpers live one folder up.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from fault_job import FaultJob, build_job
from fault_schedule import KINDS, Kill, plan_kills
from fault_stack import FaultStack
from fault_verdict import judge
from services_testbed import MAX_MODEL_LEN, MODEL, service_env

from prefixgrove.planner.client import PlannerClient, PlannerUnavailable
from prefixgrove_proto import planner_pb2 as pb

_POLL_S = 0.2
UPLOAD_KEY = "fault-campaign"
_AT_SUBMIT = ("upload", "resubmit")  # the faults the submit itself meets: at most one each
# Each kind of fault (fault_schedule.KINDS): its flag, how many the campaign fires by default, and
# what one is.
FAULTS = {
    "upload": ("--upload-kills", 1, "planner replicas killed in the middle of the upload"),
    "worker": ("--worker-kills", 2, "workers killed"),
    "planner": ("--planner-kills", 1, "planner replicas killed"),
    "redis": ("--redis-kills", 1, "times Redis is killed"),
    "resubmit": ("--resubmits", 1, "a client killed mid-upload before the job is submitted again"),
    "stall": ("--stalls", 1, "clients stalling streams"),
    "oom": ("--ooms", 1, "times Redis runs out of memory"),
}
T = TypeVar("T")
_ENDED = (pb.JOB_STATE_COMPLETED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)


@dataclass
class Run:
    """What happened to the job: its id, the kills fired, and the seconds from submit to files."""

    job_id: str = ""
    dead_client_job: str = ""  # the job a client killed mid-upload left (resubmit)
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
    for kind, (flag, default, what) in FAULTS.items():
        choices = [0, 1] if kind in _AT_SUBMIT else None
        parser.add_argument(
            flag, type=int, choices=choices, default=default, help=what, dest=kind, metavar="N"
        )
    parser.add_argument(
        "--stalled-streams",
        type=int,
        default=4,
        help="uploads, and as many watches, each stall holds",
    )
    parser.add_argument(
        "--max-deliveries", type=int, help="the workers' --max-deliveries (default: theirs)"
    )
    parser.add_argument("--workdir", type=Path, help="logs and files (default: a new temp folder)")
    parser.add_argument(
        "--reference-cache", type=Path, help="`prefixgrove run`'s files by job content, kept"
    )
    return parser.parse_args(argv)


def reference(job: Path, cache: Path | None, workdir: Path) -> tuple[Path, Path]:
    """The output and error files of `prefixgrove run` on `job`, from the cache when it has them.
    NOTE: the cache is keyed by the job's content only: empty it when the engine changes."""
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


def fire(stack: FaultStack, kill: Kill, job_id: str, stalled_streams: int) -> int | None:
    """Fires `kill` on its target, or on the next one up when it is down; returns the index of
    the process killed (0 for Redis and for the faults that kill nothing), None when none is up."""
    if kill.kind == "redis":
        stack.kill_redis(kill.down_s)
        return 0
    if kill.kind == "oom":
        stack.fill_redis(kill.down_s)
        return 0
    if kill.kind == "stall":
        streams = str(stalled_streams)
        stack.start_client("stall", "stall", target(stack), job_id, streams, streams,
                           lasts_s=kill.down_s)  # fmt: skip
        return 0
    slots = stack.workers if kill.kind == "worker" else stack.planners
    for step in range(len(slots)):
        index = (kill.target + step) % len(slots)
        if slots[index].back_at is None:
            killer = stack.kill_worker if kill.kind == "worker" else stack.kill_planner
            killer(index, kill.down_s)
            return index
    return None


class UploadSource:
    """The job's lines for `submit_lines`, read once for their fingerprint and again for each
    upload; the first upload has the replica taking it (the first address of the target) killed
    once `kill.mark` of its lines are handed over. gRPC sends them in chunks of about 1 MiB, so the
    replica holds part of them."""

    def __init__(self, stack: FaultStack, path: Path, kill: Kill | None, run: Run) -> None:
        self.stack, self.path, self.kill, self.run = stack, path, kill, run
        self.total = sum(1 for _ in path.open("rb"))
        self.reads = 0

    def __call__(self) -> Iterator[bytes]:
        self.reads += 1
        kill = self.kill if self.reads == 2 else None  # the first upload only
        at = -1 if kill is None else int(kill.mark * self.total)
        with self.path.open("rb") as lines:
            for n, line in enumerate(lines):
                if n == at and kill is not None:
                    self.stack.kill_planner(0, kill.down_s)
                    self.run.kills["upload"] += 1
                    _log(f"{n} of {self.total} lines sent: kill planner 0, down {kill.down_s} s")
                yield line.rstrip(b"\r\n")


def target(stack: FaultStack) -> str:
    """One target naming every planner replica, as a Service's name gives gRPC."""
    return "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in stack.planners)


def submit(stack: FaultStack, job: FaultJob, kills: dict[str, Kill], run: Run) -> None:
    """Submits the job under UPLOAD_KEY, after a client killed mid-upload under that key when a
    `resubmit` is planned."""
    if "resubmit" in kills:
        run.dead_client_job = die_mid_upload(stack, job, kills["resubmit"])
        run.kills["resubmit"] += 1
    client = PlannerClient(target(stack))  # no deadline: a busy machine makes a slow planner
    try:
        source = UploadSource(stack, job.path, kills.get("upload"), run)
        run.job_id = client.submit_lines(source, idempotency_key=UPLOAD_KEY).id
    finally:
        client.close()


def die_mid_upload(stack: FaultStack, job: FaultJob, kill: Kill) -> str:
    """A client sends `kill.mark` of the job's lines under UPLOAD_KEY and is killed once the job
    holds them; returns its job."""
    lines = max(1, int(kill.mark * sum(1 for _ in job.path.open("rb"))))
    client = stack.start_client("dead-client", "upload", target(stack), UPLOAD_KEY,
                                str(job.path), str(lines))  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            held = stack.call("find", lambda c: c.find_job(UPLOAD_KEY))
        except PlannerUnavailable:
            held = None
        if held is not None and held.request_counts.total >= lines:
            client.stop()
            _log(f"a client sent {held.request_counts.total} lines of job {held.id}: killed")
            return str(held.id)
        if client.proc.poll() is not None:
            raise RuntimeError(f"the client to kill mid-upload exited: {client.text()[-2000:]}")
        time.sleep(_POLL_S)
    raise RuntimeError(f"the client's {lines} lines never reached the job: {client.text()[-2000:]}")


def run_job(
    stack: FaultStack, job: FaultJob, kills: list[Kill], deadline: float, run: Run, streams: int
) -> None:
    """Submits the job, then fires each fault once its mark is reached, until the job ends or the
    deadline passes."""
    started = time.monotonic()
    submit(stack, job, {k.kind: k for k in kills if k.kind in _AT_SUBMIT}, run)
    pending = [k for k in kills if k.kind not in _AT_SUBMIT]
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
            kill = pending[0]
            killed = fire(stack, kill, run.job_id, streams)
            if killed is None:  # every target is down (killed, or dead by a poison request): the
                break  # fault waits for one to be back, and the later ones behind it, in order
            pending.pop(0)
            run.kills[kill.kind] += 1
            _log(f"+{time.monotonic() - started:.1f} s, {progress:.3f} answered: kill {kill.kind} "
                 f"{killed}, down {kill.down_s} s")  # fmt: skip
        time.sleep(_POLL_S)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def through_planners(stack: FaultStack, what: str, fn: Callable[[PlannerClient], T],
                     deadline: float) -> T:  # fmt: skip
    """fn(client) through any replica, asked again while none answers until the deadline."""
    while True:
        stack.supervise()
        try:
            return stack.call(what, fn)
        except PlannerUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(_POLL_S)


def given_up_uploads(client: PlannerClient, job_id: str) -> list[pb.Job]:
    """The campaign's other jobs: uploads the client gave up after a kill broke them."""
    return [j for j in client.list() if j.idempotency_key == UPLOAD_KEY and j.id != job_id]


def ran_nothing(job: pb.Job) -> bool:
    counts = job.request_counts
    return job.state == pb.JOB_STATE_FAILED and counts.completed == counts.failed == 0


def attack(
    stack: FaultStack, job: FaultJob, kills: list[Kill], args: argparse.Namespace, run: Run
) -> tuple[tuple[Path, Path] | None, list[pb.Job]]:
    """Runs the job under `kills`; returns its files (None when it did not complete within the
    bound) and the uploads the client gave up."""
    start = time.monotonic()
    deadline = start + args.duration_bound_s
    run_job(stack, job, kills, deadline, run, args.stalled_streams)
    files = (stack.dir / "out.jsonl", stack.dir / "out.errors.jsonl")
    got = None
    if run.state == "JOB_STATE_COMPLETED":
        # the download gets time of its own past the bound, so that a late job is still judged
        download = lambda c: c.write_results(run.job_id, *files)  # noqa: E731
        through_planners(stack, "results", download, deadline + 120)
        got = files
    run.wall_s = round(time.monotonic() - start, 1)
    given_up = through_planners(
        stack, "list", lambda c: given_up_uploads(c, run.job_id), time.monotonic() + 120
    )
    return got, given_up


def campaign(args: argparse.Namespace, workdir: Path) -> dict:
    job = build_job(workdir / "in.jsonl", args.requests, args.poison, args.job_seed)
    ref = reference(job.path, args.reference_cache, workdir)
    counts = {kind: getattr(args, kind) for kind in FAULTS}
    kills = plan_kills(args.seed, counts, {"worker": args.workers, "planner": args.planners})
    flags = () if args.max_deliveries is None else ("--max-deliveries", str(args.max_deliveries))
    stack = FaultStack.start(workdir, args.planners, args.workers, flags)
    run = Run()
    try:
        got, given_up = attack(stack, job, kills, args, run)
    finally:
        stack.stop()
    finished = got is not None
    report = {"requests": args.requests, "workers": args.workers, "planners": args.planners,
              "seed": args.seed, "job_seed": args.job_seed, "poison": len(job.poison_ids),
              "state": run.state, "kills": run.kills, "kills_planned": len(kills),
              "self_deaths": stack.self_deaths, "wall_s": run.wall_s,
              "req_per_s": round(args.requests / run.wall_s, 1) if run.wall_s else 0.0,
              "bound_s": args.duration_bound_s,
              "within_bound": finished and run.wall_s <= args.duration_bound_s,
              "uploads_given_up": len(given_up),
              "resubmit_resumed": bool(run.dead_client_job) and run.dead_client_job == run.job_id,
              "given_up_ran_nothing": all(ran_nothing(j) for j in given_up)}  # fmt: skip
    verdict = judge(got, ref, job.poison_ids, run.kills["worker"]) if got else None
    if verdict is not None:
        report.update(asdict(verdict))
    report["ok"] = (verdict is not None and verdict.ok and report["within_bound"]
                    and report["given_up_ran_nothing"])  # fmt: skip
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
