"""Every call the operator makes to the planner, in one place, in the operator's own terms."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from prefixgrove_proto import planner_pb2 as pb
from prefixgrove_proto import planner_pb2_grpc as pb_grpc

from prefixgrove.planner.security import channel
from prefixgrove.settings import SecuritySettings

_LINES_PER_CHUNK = 256

# planner JobState -> BatchJob status.phase
PHASES = {
    pb.JOB_STATE_VALIDATING: "Validating",
    pb.JOB_STATE_IN_PROGRESS: "Running",
    pb.JOB_STATE_FINALIZING: "Finalizing",
    pb.JOB_STATE_COMPLETED: "Succeeded",
    pb.JOB_STATE_FAILED: "Failed",
    pb.JOB_STATE_CANCELLING: "Cancelling",
    pb.JOB_STATE_CANCELLED: "Cancelled",
}
TERMINAL_PHASES = frozenset({"Succeeded", "Failed", "Cancelled"})


class PlannerUnavailable(RuntimeError):
    """The planner could not be reached, timed out or refused our credentials; retry later."""


class PlannerRejected(RuntimeError):
    """The planner refused the call for good (bad input, unknown job); retrying will not help."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for TLS to the planner; no CA means plaintext."""

    ca: str = ""
    client_cert: str = ""
    client_key: str = ""


@dataclass(frozen=True)
class JobView:
    id: str
    phase: str
    total: int
    completed: int
    failed: int
    started_at: float  # unix seconds, 0 when not reached
    finished_at: float
    error: str

    @property
    def sealed(self) -> bool:
        return self.phase != "Validating"

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES


def _view(job: pb.Job) -> JobView:
    counts = job.request_counts
    error = f"{job.error.code}: {job.error.message}" if job.error.code else job.error.message
    return JobView(
        id=job.id,
        phase=PHASES.get(job.state, "Pending"),
        total=counts.total,
        completed=counts.completed,
        failed=counts.failed,
        started_at=job.in_progress_at,
        finished_at=job.finished_at,
        error=error,
    )


class PlannerClient:
    def __init__(
        self, address: str, token: str = "", timeout_s: float = 10.0, tls: TlsFiles | None = None
    ) -> None:
        tls = tls or TlsFiles()
        security = SecuritySettings(
            auth_token=token or None,
            tls_ca=tls.ca or None,
            tls_client_cert=tls.client_cert or None,
            tls_client_key=tls.client_key or None,
        )
        # the planner's own channel: TLS when a CA is given, its bearer token on every call
        self._channel = channel(address, security)
        self._stub = pb_grpc.PlannerStub(self._channel)
        self._timeout = timeout_s

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request: object, timeout: float | None = None) -> object:
        try:
            return getattr(self._stub, method)(request, timeout=timeout or self._timeout)
        except grpc.RpcError as exc:
            raise _translate(exc, method) from None

    def create_job(self, model: str, idempotency_key: str, labels: dict[str, str]) -> JobView:
        """Creates the job, or returns the one this key already created."""
        request = pb.CreateJobRequest(model=model, idempotency_key=idempotency_key, metadata=labels)
        return _view(self._call("CreateJob", request))  # type: ignore[arg-type]

    def submit_lines(self, job_id: str, lines: Iterable[bytes], skip: int = 0) -> int:
        """Streams request lines into a VALIDATING job, leaving out the first `skip` (already sent
        before a restart); returns the job's line count afterwards."""
        chunks = _chunks(job_id, itertools.islice(lines, skip, None))
        response = self._call("AddRequests", chunks, timeout=max(self._timeout, 300.0))
        return int(response.total)  # type: ignore[attr-defined]

    def find_job(self, idempotency_key: str) -> JobView | None:
        """The job created with this key among the planner's newest, or None."""
        listed = self._call("ListJobs", pb.ListJobsRequest(limit=1000))
        for job in listed.jobs:  # type: ignore[attr-defined]
            if job.idempotency_key == idempotency_key:
                return _view(job)
        return None

    def seal_job(self, job_id: str) -> JobView:
        return _view(self._call("SealJob", pb.SealJobRequest(job_id=job_id)))  # type: ignore[arg-type]

    def get_job(self, job_id: str) -> JobView:
        return _view(self._call("GetJob", pb.GetJobRequest(job_id=job_id)))  # type: ignore[arg-type]

    def cancel_job(self, job_id: str) -> JobView:
        return _view(self._call("CancelJob", pb.CancelJobRequest(job_id=job_id)))  # type: ignore[arg-type]

    def queue_depth(self, model: str = "") -> int:
        """Groups waiting + leased over all jobs (of `model` when given)."""
        depth = self._call("GetQueueDepth", pb.GetQueueDepthRequest(model=model))
        return int(depth.depth)  # type: ignore[attr-defined]

    def write_results(self, job_id: str, output: Path, errors: Path) -> tuple[int, int]:
        """Writes the outputs and the errors of a finished job, in input order, each file replaced
        whole so a retry never leaves a half-written one; returns (outputs, errors) written."""
        written = []
        for kind, path in ((pb.RESULT_KIND_OUTPUT, output), (pb.RESULT_KIND_ERROR, errors)):
            request = pb.StreamResultsRequest(job_id=job_id, offset=0, kind=kind, follow=False)
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".partial")
            count = 0
            try:
                with partial.open("w", encoding="utf-8") as out:
                    for line in self._stub.StreamResults(
                        request, timeout=max(self._timeout, 600.0)
                    ):
                        out.write(line.line + "\n")
                        count += 1
            except grpc.RpcError as exc:
                raise _translate(exc, "StreamResults") from None
            partial.replace(path)
            written.append(count)
        return written[0], written[1]


def _chunks(job_id: str, lines: Iterable[bytes]) -> Iterator[pb.AddRequestsChunk]:
    it = iter(lines)
    first = True
    while batch := list(itertools.islice(it, _LINES_PER_CHUNK)):
        yield pb.AddRequestsChunk(job_id=job_id if first else "", lines=batch)
        first = False
    if first:  # an empty input still opens the stream, so the planner learns of it at seal time
        yield pb.AddRequestsChunk(job_id=job_id, lines=[])


_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    # what a request stream broken on our side (an input file unreadable midway) ends with
    grpc.StatusCode.CANCELLED,
    # a wrong token is the operator's configuration, not the job's fault: wait for it to be fixed
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
}


def _translate(exc: grpc.RpcError, method: str) -> Exception:
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    message = f"planner {method}: {code.name}: {detail}"
    if code in _RETRYABLE:
        return PlannerUnavailable(message)
    return PlannerRejected(code, message)
