"""BatchJob status fields built from what the planner reports, and Kubernetes-style conditions."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixgrove_proto import planner_pb2 as pb

# planner job state -> BatchJob status.phase. NOTE: the proto's JOB_STATE_FINALIZING is never sent
# by the planner; the operator's own "Finalizing" is a job whose planner job is final while its last
# results are not written yet, and its own "Queued" an in-progress job no worker has run any of.
PHASES = {
    pb.JOB_STATE_VALIDATING: "Validating",
    pb.JOB_STATE_IN_PROGRESS: "Running",
    pb.JOB_STATE_COMPLETED: "Succeeded",
    pb.JOB_STATE_FAILED: "Failed",
    pb.JOB_STATE_CANCELLING: "Cancelling",
    pb.JOB_STATE_CANCELLED: "Cancelled",
}
TERMINAL_PHASES = frozenset({"Succeeded", "Failed", "Cancelled"})


@dataclass(frozen=True)
class JobView:
    """A planner job in the operator's terms."""

    id: str
    phase: str
    total: int
    completed: int
    failed: int
    started_at: float  # unix seconds, 0 when not reached
    finished_at: float
    error: str
    groups_leased: int = 0
    groups_done: int = 0
    eta_s: float = -1.0  # the planner's live ETA; -1: unknown
    plan: Mapping[str, Any] | None = None  # a dry run's plan (plan_status)

    @property
    def sealed(self) -> bool:
        return self.phase != "Validating"

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES

    @property
    def answered(self) -> int:
        return self.completed + self.failed


def job_view(job: pb.Job) -> JobView:
    counts = job.request_counts
    error = f"{job.error.code}: {job.error.message}" if job.error.code else job.error.message
    phase = PHASES.get(job.state, "Pending")
    # NOTE: not counts.failed: the planner fails invalid lines itself, before any worker runs
    served = job.queue.groups_leased or job.groups_done or counts.completed
    if phase == "Running" and not served:
        phase = "Queued"
    return JobView(
        id=job.id,
        phase=phase,
        total=counts.total,
        completed=counts.completed,
        failed=counts.failed,
        started_at=job.in_progress_at,
        finished_at=job.finished_at,
        error=error,
        groups_leased=job.queue.groups_leased,
        groups_done=job.groups_done,
        eta_s=job.eta_s,
        plan=plan_status(job.plan) if job.dry_run and job.HasField("plan") else None,
    )


def plan_status(plan: pb.JobPlan) -> dict[str, Any]:
    """A dry run's plan as BatchJob status shows it (docs/plan.md says what each field is)."""
    devices = [
        {"kind": d.kind, "unavailable": d.unavailable}
        if d.unavailable
        else {"kind": d.kind, "gpus": d.gpus, "tensorParallelSize": d.tensor_parallel_size,
              "wall": duration(d.wall_s), "gpuHours": round(d.gpu_hours, 4),
              "calibration": d.calibration + (" (borrowed)" if d.borrowed else "")}
        for d in plan.devices
    ]  # fmt: skip
    return {
        "requests": plan.requests,
        "invalidLines": plan.invalid_lines,
        "promptTokens": plan.prompt_tokens,
        "prefillTokens": plan.prefill_tokens,
        "saved": f"{100 * plan.saved_share:.1f}%",
        "groups": plan.groups,
        "largestGroup": plan.largest_group,
        "outputTokens": plan.output_tokens,
        "outputTokensExact": plan.output_exact,
        "devices": devices,
    }


def duration(seconds: float) -> str:
    """Seconds as kubectl shows ages: 45s, 12m, 3h20m."""
    s = max(int(seconds), 0)
    if s < 120:
        return f"{s}s"
    if s < 3 * 3600:
        return f"{s // 60}m"
    return f"{s // 3600}h{s % 3600 // 60}m"


def rfc3339(unix_s: float | None = None) -> str:
    moment = (
        dt.datetime.now(dt.UTC) if unix_s is None else dt.datetime.fromtimestamp(unix_s, dt.UTC)
    )
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def progress(done: int, total: int) -> str:
    if total <= 0:
        return "0%"
    return f"{100 * done // total}%"


def with_condition(
    conditions: Sequence[Mapping[str, Any]] | None,
    kind: str,
    state: bool,
    reason: str,
    message: str,
    generation: int | None = None,
) -> list[dict[str, Any]]:
    """`conditions` with `kind` set; lastTransitionTime moves only when the status flips."""
    value = "True" if state else "False"
    out: list[dict[str, Any]] = []
    old: Mapping[str, Any] | None = None
    for condition in conditions or ():
        if condition.get("type") == kind:
            old = condition
        else:
            out.append(dict(condition))
    since = old["lastTransitionTime"] if old and old.get("status") == value else rfc3339()
    new: dict[str, Any] = {
        "type": kind,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
    }
    if generation is not None:
        new["observedGeneration"] = generation
    out.append(new)
    return out


def job_status(
    job: JobView, conditions: Sequence[Mapping[str, Any]] | None, first_failure: str = ""
) -> dict[str, Any]:
    """The status patch for a job as the planner sees it, before its last results are written: a
    final planner job is Finalizing until then (final_status ends it). `first_failure` is the first
    failed request seen so far, for the RequestsFailed message."""
    status: dict[str, Any] = {
        "jobId": job.id,
        "phase": "Finalizing" if job.terminal else job.phase,
        "requestCounts": {"total": job.total, "completed": job.completed, "failed": job.failed},
        "progress": progress(job.answered, job.total),
    }
    if job.started_at:
        status["startTime"] = rfc3339(job.started_at)
    if not job.terminal and job.eta_s >= 0:
        status["eta"], status["etaSeconds"] = duration(job.eta_s), round(job.eta_s)
    if job.plan is not None:
        status["plan"] = dict(job.plan)
    if first_failure:
        status["firstFailure"] = first_failure
    if job.failed:
        status["conditions"] = with_condition(
            conditions, "RequestsFailed", True, "RequestsFailed", failed_message(job, first_failure)
        )
    return status


def final_status(
    job: JobView,
    conditions: Sequence[Mapping[str, Any]] | None,
    wrote: str,
    stopped: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """The status of a BatchJob whose planner job is final and whose results are all written;
    `wrote` says where. `stopped`, (reason, message), is the operator's own verdict, which
    decides over the planner's: a job it stopped ends Failed, never also Cancelled."""
    if stopped is None and job.phase == "Failed":
        stopped = ("JobFailed", job.error or "the planner marked the job failed")
    if stopped is not None:
        (phase, kind), (reason, why) = ("Failed", "Failed"), stopped
    elif job.phase == "Cancelled":
        phase, kind, reason, why = "Cancelled", "Cancelled", "Cancelled", "cancelled"
    else:
        phase, kind, reason, why = "Succeeded", "Complete", "Succeeded", wrote
    return {
        "phase": phase,
        "message": wrote if phase == "Succeeded" else f"{why}; {wrote}",
        "eta": None,  # nothing left
        "etaSeconds": None,
        "completionTime": rfc3339(job.finished_at or None),
        "conditions": with_condition(conditions, kind, True, reason, why),
    }


def failed_message(job: JobView, first_failure: str = "") -> str:
    counts = f"{job.failed} of {job.total} requests failed ({job.completed} completed)"
    return f"{counts}; the first: {first_failure}" if first_failure else counts


def failed_status(
    reason: str, message: str, conditions: Sequence[Mapping[str, Any]] | None
) -> dict[str, Any]:
    """Status for a BatchJob that can never run as written."""
    return {
        "phase": "Failed",
        "message": message,
        "completionTime": rfc3339(),
        "conditions": with_condition(conditions, "Failed", True, reason, message),
    }
