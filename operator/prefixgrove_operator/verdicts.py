"""When the operator itself ends a BatchJob the planner would keep running: no worker serves its
model, or more of its requests failed than its owner accepts."""

from __future__ import annotations

from dataclasses import dataclass

from prefixgrove_operator.settings import OperatorSettings
from prefixgrove_operator.spec import BatchJobSpec
from prefixgrove_operator.status import JobView


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
