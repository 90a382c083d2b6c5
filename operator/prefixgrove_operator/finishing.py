"""What a status round does with a BatchJob's results: appends the lines answered since the last
round, notes the first failed one (and warns of it), and ends the BatchJob once its planner job is
final and its last lines are written."""

from __future__ import annotations

from typing import Any

import kopf
from kubernetes import client

from prefixgrove.planner.client import PlannerClient, PlannerUnavailable
from prefixgrove.storage.locations import StorageError
from prefixgrove_operator.credentials import secret_credentials
from prefixgrove_operator.object_results import append_new_objects
from prefixgrove_operator.results import Failure, Progress, append_new_results
from prefixgrove_operator.spec import BatchJobSpec, InvalidSpec
from prefixgrove_operator.status import JobView, failed_message, final_status, with_condition
from prefixgrove_operator.verdicts import Verdict


def append_results(
    planner: PlannerClient, core: client.CoreV1Api, namespace: str, job_id: str,
    job_spec: BatchJobSpec, finished: bool,
) -> tuple[Progress, Failure | None]:  # fmt: skip
    """Appends the results answered since the last call to the job's files on the volume, or to
    its objects (with the credentials of its Secret, read now: it may have been rotated)."""
    if job_spec.output_path is None or job_spec.errors_path is None:
        credentials = secret_credentials(core, namespace, job_spec.credentials_secret)
        return append_new_objects(planner, job_id, job_spec.output_url, job_spec.errors_url,
                                  finished, credentials)  # fmt: skip
    return append_new_results(planner, job_id, job_spec.output_path, job_spec.errors_path, finished)


def write_results(
    job: JobView,
    job_spec: BatchJobSpec,
    body: kopf.Body,
    planner: PlannerClient,
    core: client.CoreV1Api,
    new: dict[str, Any],
    target: Verdict | None,
) -> dict[str, Any]:
    """Appends new results; once the planner job is final, writes every line left and ends the
    BatchJob. Files that cannot be written leave it as it stands (Finalizing, once the planner
    job is final) until they can."""
    output = job_spec.output_name
    namespace = body.metadata.namespace or "default"
    try:
        written, failure = append_results(planner, core, namespace, job.id, job_spec, job.terminal)
    except (PlannerUnavailable, OSError, InvalidSpec) as exc:
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
    errors = job_spec.errors_name
    wrote = f"wrote {written.outputs} outputs to {output} and {written.errors} errors to {errors}"
    never = job.total - job.answered
    return f"{wrote} ({never} of them requests never run)" if never > 0 else wrote


def why(exc: Exception) -> str:
    # an OSError's strerror, not its text: that names the operator's own paths. A StorageError's
    # text names the URL and the cause, never a credential (storage/stores.py)
    if isinstance(exc, OSError) and not isinstance(exc, StorageError):
        return str(exc.strerror)
    return str(exc)


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
