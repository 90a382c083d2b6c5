"""A job as the planner's calls see it: found by id (NOT_FOUND otherwise), answered as its proto
message, and looked at again every POLL_S while a call waits for it to change."""

from __future__ import annotations

import time

import grpc

from prefixgrove.jobs.redis_store.schema import JobRecord, JobState
from prefixgrove.jobs.redis_store.store import JobStore, QueueDepth
from prefixgrove.planner.dry_runs import plan_to_pb
from prefixgrove.planner.eta import eta_seconds
from prefixgrove_proto import planner_pb2 as pb

POLL_S = 0.25
# characters of a job id: ours are "job_" and 20 hex digits; a longer one is refused unread, and
# unquoted (a status message travels in one HTTP/2 header, which clients cap)
MAX_JOB_ID = 64
# NOTE: the proto's JOB_STATE_FINALIZING has no JobState: results are final as workers write them.
_PB_STATES = {
    JobState.VALIDATING: pb.JOB_STATE_VALIDATING,
    JobState.IN_PROGRESS: pb.JOB_STATE_IN_PROGRESS,
    JobState.COMPLETED: pb.JOB_STATE_COMPLETED,
    JobState.FAILED: pb.JOB_STATE_FAILED,
    JobState.CANCELLING: pb.JOB_STATE_CANCELLING,
    JobState.CANCELLED: pb.JOB_STATE_CANCELLED,
}


def find_job(store: JobStore, job_id: str, context: grpc.ServicerContext) -> JobRecord:
    if len(job_id) > MAX_JOB_ID:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"a job_id of {len(job_id)} characters is no job's: ids are at most {MAX_JOB_ID}",
        )
    job = store.get_job(job_id) if job_id else None
    if job is None:
        context.abort(grpc.StatusCode.NOT_FOUND, f"job {job_id!r} does not exist")
    return job  # type: ignore[return-value]


# JobRecord's fields that pb.Job carries under the same name, as they are
_SAME_FIELDS = ("id", "idempotency_key", "model", "groups_total", "groups_done",
                "prefix_tokens_saved", "prompt_tokens", "completion_tokens", "created_at",
                "in_progress_at", "finished_at", "metadata")  # fmt: skip


def job_to_pb(job: JobRecord, store: JobStore) -> pb.Job:
    error = pb.JobError(code=job.error_code, message=job.error_message) if job.error_code else None
    return pb.Job(
        state=_PB_STATES[job.state],
        request_counts=pb.RequestCounts(
            total=job.total, completed=job.completed, failed=job.failed
        ),
        queue=queue_depth_to_pb(store.job_queue(job)),
        error=error,
        plan=plan_to_pb(job.plan) if job.plan else None,
        dry_run=bool(job.dry_run),
        eta_s=eta_seconds(job, time.time()),
        **{name: getattr(job, name) for name in _SAME_FIELDS},
    )


def without_eta(job: pb.Job) -> pb.Job:
    """The job as a watcher compares it: all but its ETA, which moves with the clock."""
    copy = pb.Job()
    copy.CopyFrom(job)
    copy.ClearField("eta_s")
    return copy


def queue_depth_to_pb(depth: QueueDepth) -> pb.QueueDepth:
    return pb.QueueDepth(
        groups_waiting=depth.waiting, groups_leased=depth.leased, depth=depth.depth
    )
