"""What a status round does with a BatchJob's results: appends the lines answered since the last
round, notes the first failed one (and warns of it), and ends the BatchJob once its planner job is
final and its last lines are written."""

from __future__ import annotations

from typing import Any

import kopf

from prefixgrove.planner.client import PlannerClient, PlannerUnavailable
from prefixgrove_operator.results import Progress, append_new_results
from prefixgrove_operator.spec import BatchJobSpec, on_volume
from prefixgrove_operator.status import JobView, failed_message, final_status, with_condition
from prefixgrove_operator.verdicts import Verdict


def write_results(
    job: JobView,
    job_spec: BatchJobSpec,
    body: kopf.Body,
    planner: PlannerClient,
    new: dict[str, Any],
    target: Verdict | None,
) -> dict[str, Any]:
    """Appends new results; once the planner job is final, writes every line left and ends the
    BatchJob. Files that cannot be written leave it as it stands (Finalizing, once the planner
    job is final) until they can."""
    output = on_volume(job_spec.volume_root, job_spec.output_path)
    try:
        written, failure = append_new_results(
            planner, job.id, job_spec.output_path, job_spec.errors_path, job.terminal
        )
    except (PlannerUnavailable, OSError) as exc:
        kopf.warn(body, reason="OutputNotWritten", message=f"retrying {output}: {why(exc)}")
        return {}
    update: dict[str, Any] = {}
    if failure is not None and not new.get("firstFailure"):
        update["firstFailure"] = str(failure)
        update["conditions"] = with_condition(
            new.get("conditions"), "RequestsFailed", True, "RequestsFailed",
            failed_message(job, str(failure)),
        )  # fmt: skip
    if job.terminal:
        wrote = wrote_message(job, job_spec, output, written)
        stopped = (target.reason, target.message) if target else None
        conditions = update.get("conditions", new.get("conditions"))
        update.update(final_status(job, conditions, wrote, stopped))
    return update


def wrote_message(job: JobView, job_spec: BatchJobSpec, output: str, written: Progress) -> str:
    errors = on_volume(job_spec.volume_root, job_spec.errors_path)
    wrote = f"wrote {written.outputs} outputs to {output} and {written.errors} errors to {errors}"
    never = job.total - job.answered
    return f"{wrote} ({never} of them requests never run)" if never > 0 else wrote


def why(exc: Exception) -> str:
    # an OSError's strerror, not its text: that names the operator's own paths
    return str(exc.strerror) if isinstance(exc, OSError) else str(exc)


def warn_of_failed_requests(body: kopf.Body, status: kopf.Status, new: dict[str, Any]) -> None:
    """A Warning whenever more requests failed, naming the first failed line. NOTE: results are
    read in input order, so the first failure is known only once every line before it was
    answered; the Warning waits for it."""
    if not new.get("firstFailure"):
        return
    before = (status.get("requestCounts") or {}).get("failed", 0)
    if new["requestCounts"]["failed"] > before or not status.get("firstFailure"):
        (condition,) = [c for c in new["conditions"] if c["type"] == "RequestsFailed"]
        kopf.warn(body, reason="RequestsFailed", message=condition["message"])
