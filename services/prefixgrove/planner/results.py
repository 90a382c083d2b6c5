"""StreamResults: a job's result lines in input order, read from Redis a window at a time, until
the job's last line (or, with `follow`, as workers write them)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc

from prefixgrove.jobs.output_lines import run_tag
from prefixgrove.jobs.redis_store.schema import JobRecord, JobState, ResultRecord
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.planner.job_messages import POLL_S, find_job
from prefixgrove_proto import planner_pb2 as pb

# Results are read from Redis a window at a time, sized to about _RESULT_WINDOW_BYTES by the
# lines of the last window (logprobs lines run to hundreds of KB, plain ones to a few hundred
# bytes), so a stream holds a few MB whatever the lines, and the first window is small.
_RESULT_WINDOW = 512
_FIRST_RESULT_WINDOW = 16
_RESULT_WINDOW_BYTES = 4 << 20


def stream_results(
    store: JobStore, request: pb.StreamResultsRequest, context: grpc.ServicerContext
) -> Iterator[pb.ResultLine]:
    job = find_job(store, request.job_id, context)
    if request.offset < 0:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"offset must be >= 0, got {request.offset}"
        )
    kind = request.kind or pb.RESULT_KIND_OUTPUT
    index = request.offset
    window = _FIRST_RESULT_WINDOW
    while context.is_active():
        job = find_job(store, job.id, context)
        if job.state != JobState.VALIDATING and index >= job.total:
            return
        results = store.read_results(job.id, index, window)
        window = _next_window(results)
        missing = _unanswered_lines(store, job, index, results) if request.unanswered else {}
        for result in results:
            if result is None:
                if not job.state.terminal:
                    break
                # never answered (a cancelled or failed job): sent only when asked for
                if index in missing and kind != pb.RESULT_KIND_OUTPUT:
                    yield pb.ResultLine(index=index, is_error=True, line=missing[index])
            elif kind == pb.RESULT_KIND_ALL or result.is_error == (kind == pb.RESULT_KIND_ERROR):
                yield pb.ResultLine(index=index, is_error=result.is_error, line=result.line)
            index += 1
        else:
            continue
        if not request.follow:
            return
        time.sleep(POLL_S)


def _unanswered_lines(
    store: JobStore, job: JobRecord, start: int, results: list[ResultRecord | None]
) -> dict[int, str]:
    """The error line of each request of a finished job in `results` (from index `start`) that
    was never answered; none while the job may still answer them."""
    if not job.state.terminal:
        return {}
    indices = [start + i for i, result in enumerate(results) if result is None]
    indices = [i for i in indices if i < job.total]
    if job.state == JobState.CANCELLED:
        code, message = "cancelled", "the job was cancelled before this request was answered"
    else:
        why = f" ({job.error_code}: {job.error_message})" if job.error_code else ""
        code, message = "not_run", f"the job failed before this request was answered{why}"
    ids = store.read_custom_ids(job.id, indices)
    tag = run_tag(job.id)
    return {
        i: RequestError(i, c, code, message).to_line(tag) for i, c in zip(indices, ids, strict=True)
    }


def _next_window(results: list[ResultRecord | None]) -> int:
    """How many results to read next: about _RESULT_WINDOW_BYTES of lines like these."""
    lines = [len(r.line) for r in results if r is not None]
    if not lines:
        return _RESULT_WINDOW
    return max(1, min(_RESULT_WINDOW, _RESULT_WINDOW_BYTES * len(lines) // max(sum(lines), 1)))
