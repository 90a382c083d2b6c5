"""OpenAI batches over prefixgrove jobs: a batch is a job (same id), created and fed through
PlannerService's own calls, so an HTTP batch passes the checks a gRPC upload passes.

What a job does not hold of the batch (its input file and endpoint) travels in the job's
metadata under the reserved keys below, hidden from the batch's `metadata`."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prefixgrove.input_lines import line_batches
from prefixgrove.jobs.redis_store import schema
from prefixgrove.jobs.redis_store.schema import JobRecord, JobState
from prefixgrove.planner.http.errors import ApiError, ServiceCall, not_found
from prefixgrove.planner.http.files import Files
from prefixgrove.planner.service import PlannerService
from prefixgrove_proto import planner_pb2 as pb

log = logging.getLogger(__name__)
INPUT_FILE_KEY = "openai.input_file_id"
ENDPOINT_KEY = "openai.endpoint"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
COMPLETION_WINDOW = "24h"
_WINDOW_S = 24 * 3600
_CHUNK_BYTES = 1 << 20  # lines handed to the service at once, as the gRPC client sends them
_CHUNK_LINES = 1 << 16
MAX_LIST = 100  # batches in one list answer
_STATUS = {  # a job's results are final as workers write them: it never shows `finalizing`
    JobState.VALIDATING: "validating",
    JobState.IN_PROGRESS: "in_progress",
    JobState.COMPLETED: "completed",
    JobState.FAILED: "failed",
    JobState.CANCELLING: "cancelling",
    JobState.CANCELLED: "cancelled",
}
_RESULT_FILES = {"output": pb.RESULT_KIND_OUTPUT, "errors": pb.RESULT_KIND_ERROR}


class Batches:
    """Creates, reads, lists and cancels batches; `feeders` stream inputs into their jobs."""

    def __init__(self, service: PlannerService, files: Files, feeders: ThreadPoolExecutor) -> None:
        self.service = service
        self.files = files
        self.feeders = feeders

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """A job for the batch, its input streaming in behind the answer (status `validating`)."""
        metadata = _checked_request(body)
        input_path = self.files.source(body["input_file_id"])
        metadata |= {INPUT_FILE_KEY: body["input_file_id"], ENDPOINT_KEY: body["endpoint"]}
        options = _dry_run(body)
        request = pb.CreateJobRequest(metadata=metadata, dry_run=options is not None,
                                      plan_options=options)  # fmt: skip
        created = self.service.CreateJob(request, ServiceCall())
        self.feeders.submit(self._feed, created.id, input_path)
        return self.get(created.id)

    def get(self, batch_id: str) -> dict[str, Any]:
        return batch_object(self.job(batch_id))

    def job(self, batch_id: str) -> JobRecord:
        job = self.service.store.get_job(batch_id) if batch_id.startswith("job_") else None
        if job is None:
            raise not_found("batch", batch_id)
        return job

    def cancel(self, batch_id: str) -> dict[str, Any]:
        self.job(batch_id)
        self.service.CancelJob(pb.CancelJobRequest(job_id=batch_id), ServiceCall())
        return self.get(batch_id)

    def list(self, after: str | None, limit: int) -> dict[str, Any]:
        """Newest first, `limit` of them (1 to MAX_LIST); a page starts after the batch `after`
        names."""
        start = 0
        if after:
            # NOTE: the position in the store's newest-first index of jobs, which list_jobs pages by
            rank = self.service.store.r.zrevrank(schema.JOBS, after)
            if rank is None:
                raise not_found("batch", after)
            start = int(rank) + 1  # type: ignore[arg-type]
        jobs, more = self.service.store.list_jobs(limit, start)
        data = [batch_object(job) for job in jobs]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return {"object": "list", "data": data, "first_id": first, "last_id": last,
                "has_more": more}  # fmt: skip

    def result_lines(self, file_id: str) -> tuple[JobRecord, Iterator[str]]:
        """The job behind a result file id, and that file's lines in input order."""
        kind, job = self._result_file(file_id)
        request = pb.StreamResultsRequest(job_id=job.id, kind=kind, follow=False)
        lines = (r.line for r in self.service.StreamResults(request, ServiceCall()))
        return job, lines

    def _result_file(self, file_id: str) -> tuple[pb.ResultKind, JobRecord]:
        parts = file_id.split("-", 2)
        name, batch_id = (parts[1], parts[2]) if len(parts) == 3 else ("", "")
        job = self.service.store.get_job(batch_id) if name in _RESULT_FILES else None
        if job is None or file_id not in _result_file_ids(job):
            raise not_found("file", file_id)
        return _RESULT_FILES[name], job

    def _feed(self, job_id: str, input_path: Path | str) -> None:
        """Streams the input into the job and seals it; a refused input fails the job, and its
        record says why (the batch's `errors`)."""
        call = ServiceCall()
        try:
            max_line_bytes = self.service.ingest_settings.max_line_bytes
            self.service.AddRequests(_chunks(job_id, input_path, max_line_bytes), call)
            self.service.SealJob(pb.SealJobRequest(job_id=job_id), call)
        except ApiError as exc:
            log.info("batch %s was not queued: %s", job_id, exc.message)
        except Exception:
            log.exception("batch %s: its input did not stream in", job_id)
            interrupted = pb.CancelJobRequest(job_id=job_id, upload_interrupted=True)
            self.service.CancelJob(interrupted, call)


def is_result_file(file_id: str) -> bool:
    return file_id.startswith(tuple(f"file-{name}-" for name in _RESULT_FILES))


def batch_object(job: JobRecord) -> dict[str, Any]:
    finished = int(job.finished_at) or None
    metadata = {k: v for k, v in job.metadata.items() if k not in (INPUT_FILE_KEY, ENDPOINT_KEY)}
    output_id, error_id = _result_file_ids(job)
    return {
        "id": job.id,
        "object": "batch",
        "endpoint": job.metadata.get(ENDPOINT_KEY, ""),
        "errors": _errors(job),
        "input_file_id": job.metadata.get(INPUT_FILE_KEY, ""),
        "completion_window": COMPLETION_WINDOW,
        "status": _STATUS[job.state],
        "output_file_id": output_id,
        "error_file_id": error_id,
        "created_at": int(job.created_at),
        "in_progress_at": int(job.in_progress_at) or None,
        "expires_at": int(job.created_at) + _WINDOW_S,
        "finalizing_at": None,
        "completed_at": finished if job.state == JobState.COMPLETED else None,
        "failed_at": finished if job.state == JobState.FAILED else None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": finished if job.state == JobState.CANCELLED else None,
        "request_counts": {"total": job.total, "completed": job.completed, "failed": job.failed},
        "metadata": metadata or None,
        "model": job.model,
        "usage": _usage(job),
        # a dry run's plan (docs/plan.md), beside OpenAI's fields: its clients keep fields they
        # do not know (batch.plan, or model_extra)
        **({"plan": json.loads(job.plan)} if job.plan and job.dry_run else {}),
    }


def _usage(job: JobRecord) -> dict[str, Any]:
    """Tokens so far; the prompt tokens a shared prefix let the engine skip count as cached."""
    return {
        "input_tokens": job.prompt_tokens,
        "input_tokens_details": {"cached_tokens": job.prefix_tokens_saved},
        "output_tokens": job.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": job.prompt_tokens + job.completion_tokens,
    }


def _result_file_ids(job: JobRecord) -> tuple[str | None, str | None]:
    """A finished batch's output and error files, where it has lines for them."""
    if not job.state.terminal:
        return None, None
    output = f"file-output-{job.id}" if job.completed else None
    errors = f"file-errors-{job.id}" if job.failed else None
    return output, errors


def _errors(job: JobRecord) -> dict[str, Any] | None:
    if not job.error_code:
        return None
    error = {"code": job.error_code, "message": job.error_message, "param": None, "line": None}
    return {"object": "list", "data": [error]}


def _checked_request(body: dict[str, Any]) -> dict[str, str]:
    """The batch's own metadata, once the request is one we serve."""
    if not isinstance(body.get("input_file_id"), str):
        raise ApiError(
            400, "input_file_id is required: the id of a file uploaded for purpose batch"
        )
    if body.get("endpoint") not in ENDPOINTS:
        raise ApiError(400, f"endpoint {body.get('endpoint')!r} is not served: expected one of "
                            f"{', '.join(ENDPOINTS)}")  # fmt: skip
    if body.get("completion_window") != COMPLETION_WINDOW:
        raise ApiError(400, f"completion_window {body.get('completion_window')!r} is invalid: "
                            f"expected {COMPLETION_WINDOW!r}")  # fmt: skip
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and not k.startswith("openai.")
        for k, v in metadata.items()
    ):
        raise ApiError(400, "metadata must map strings to strings (keys not starting openai.)")
    return dict(metadata)


def _dry_run(body: dict[str, Any]) -> pb.PlanOptions | None:
    """The batch's `dry_run` (an extension: extra_body in OpenAI's SDK): true, or the plan
    options as an object (PlanOptions' fields); absent or false: a batch that runs."""
    value = body.get("dry_run", False)
    if value is False:
        return None
    if value is True:
        return pb.PlanOptions()
    try:
        return pb.PlanOptions(**value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        fields = ", ".join(pb.PlanOptions.DESCRIPTOR.fields_by_name)
        raise ApiError(400, f"dry_run {value!r} is invalid ({exc}): expected true, or an object "
                            f"of {fields}") from None  # fmt: skip


def _chunks(job_id: str, path: Path | str, max_line_bytes: int) -> Iterator[pb.AddRequestsChunk]:
    """The file's lines in chunks of about 1 MiB, read in bounded memory (a line over the limit
    is never held whole: input_lines.py); an empty file still sends one chunk."""
    batches = line_batches(path, max_line_bytes, max_lines=_CHUNK_LINES, max_bytes=_CHUNK_BYTES)
    sent = False
    for batch in batches:
        yield pb.AddRequestsChunk(job_id=job_id, lines=batch)
        sent = True
    if not sent:
        yield pb.AddRequestsChunk(job_id=job_id, lines=[])
