"""When the operator itself ends a BatchJob the planner would keep running: no worker serves its
model, or more of its requests failed than its owner accepts.

A verdict cancels the planner job and is kept as the BatchJob's FailureTarget condition (as a
Kubernetes Job keeps its own) while the cancel drains; the BatchJob ends Failed with that reason
once the planner job is final and its last results are written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixgrove_operator.settings import OperatorSettings
from prefixgrove_operator.spec import BatchJobSpec
from prefixgrove_operator.status import JobView

FAILURE_TARGET = "FailureTarget"


@dataclass(frozen=True)
class Verdict:
    """Why a job is stopped: a condition reason and a message for its owner."""

    reason: str
    message: str


def queue_timeout_s(spec: BatchJobSpec, settings: OperatorSettings) -> float:
    return spec.queue_timeout_s if spec.queue_timeout_s is not None else settings.queue_timeout_s


def unserved_warning_s(spec: BatchJobSpec, settings: OperatorSettings) -> float:
    return min(settings.unserved_warning_s, queue_timeout_s(spec, settings))


def unserved_message(spec: BatchJobSpec, settings: OperatorSettings, queued_s: float) -> str:
    return (
        f"no worker has taken any request of model {spec.model!r} in {queued_s:.0f}s: is a worker "
        f"serving it running? The job fails after {queue_timeout_s(spec, settings):.0f}s queued "
        "(spec.queueTimeoutSeconds)"
    )


def stop_verdict(
    job: JobView, spec: BatchJobSpec, settings: OperatorSettings, queued_s: float
) -> Verdict | None:
    """Why `job` must be stopped now, or None. `queued_s`: how long it has been Queued."""
    ratio = spec.max_failed_ratio
    if ratio is not None and job.total and job.failed / job.total > ratio:
        return Verdict(
            "TooManyFailedRequests",
            f"{job.failed} of {job.total} requests failed, more than spec.maxFailedRatio {ratio}",
        )
    if job.phase == "Queued" and queued_s >= queue_timeout_s(spec, settings):
        return Verdict("Unserved", unserved_message(spec, settings, queued_s))
    return None


def failure_target(conditions: Sequence[Mapping[str, Any]] | None) -> Verdict | None:
    """The verdict an earlier round reached and kept as the FailureTarget condition, or None."""
    for condition in conditions or ():
        if condition.get("type") == FAILURE_TARGET and condition.get("status") == "True":
            return Verdict(str(condition.get("reason")), str(condition.get("message")))
    return None
