"""The one client of the Planner service, for the CLI, the operator, tests and scripts.

Every call goes through `_call` (or `_stream` for a server stream): a transport error leaves it as
one of two domain errors, so a caller needs three `except` clauses at most: `PlannerUnavailable`
(retry later), `PlannerRejected` (retrying will not help) and its own.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc

from prefixgrove.input_lines import bounded_lines, open_source
from prefixgrove.output_files import replaced
from prefixgrove.planner import input_digest
from prefixgrove.planner.download import download as download_results
from prefixgrove.planner.input_digest import Fingerprint, is_request_line
from prefixgrove.planner.security import channel
from prefixgrove.settings import MAX_LINE_BYTES_LIMIT, SecuritySettings
from prefixgrove_proto import planner_pb2 as pb
from prefixgrove_proto import planner_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_CHUNK_BYTES = 1 << 20
UPLOAD_ATTEMPTS = 3  # uploads of one submission, the first included
_SEAL_ATTEMPTS = 5
_RETRY_PAUSE_S = 1.0  # times the attempt number: the channel reconnects meanwhile
# error codes of a job whose upload failed, worth submitting again (its idempotency key is free)
_UPLOAD_LOST = ("ingest_interrupted", "upload_abandoned", "input_mismatch", "redis_out_of_memory")
# a call that moves a whole job's lines gets at least these deadlines, when calls have one at all
_RESULTS_TIMEOUT_S = 600.0
_UPLOAD_TIMEOUT_S = 300.0


def state_name(state: int) -> str:
    """A planner job state as people read it: JOB_STATE_IN_PROGRESS -> "in_progress"."""
    return pb.JobState.Name(state).removeprefix("JOB_STATE_").lower()


class PlannerError(RuntimeError):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PlannerUnavailable(PlannerError):
    """The planner could not be reached, timed out or refused our credentials; retry later."""


class PlannerRejected(PlannerError):
    """The planner refused the call for good (bad input, unknown job); retrying will not help."""


class PlannerClient:
    """`timeout_s` bounds every call but the streams that follow a job (`watch`, `results` with
    follow=True), which last as long as the job; None waits as long as the planner takes."""

    def __init__(
        self,
        target: str,
        security: SecuritySettings | None = None,
        *,
        tls: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        self.channel = channel(target, security or SecuritySettings(), tls=tls)
        self._stub = pb_grpc.PlannerStub(self.channel)
        self._timeout = timeout_s

    def close(self) -> None:
        self.channel.close()

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=timeout or self._timeout)
        except grpc.RpcError as exc:
            raise _translate(exc, method) from None

    def _stream(self, method: str, request: Any, timeout: float | None) -> Iterator[Any]:
        """Closing the iterator early cancels the call, so the planner frees its stream slot."""
        call = getattr(self._stub, method)(request, timeout=timeout)
        try:
            yield from call
        except grpc.RpcError as exc:
            raise _translate(exc, method) from None
        finally:
            call.cancel()

    # --- jobs ---------------------------------------------------------------------------------
    def create_job(
        self,
        model: str = "",
        idempotency_key: str = "",
        metadata: dict[str, str] | None = None,
        fingerprint: Fingerprint | None = None,
        source: pb.InputSource | None = None,
        dry_run: pb.PlanOptions | None = None,
    ) -> pb.Job:
        """Creates the job, or returns the one this key already created (refused with
        ALREADY_EXISTS when that one was created with another input's `fingerprint`). With
        `source`, the planner reads the input from object storage and seals the job itself.
        With `dry_run`, the sealed job ends completed with its plan for those options (Job.plan)
        and nothing runs."""
        request = pb.CreateJobRequest(
            model=model, idempotency_key=idempotency_key, metadata=metadata or {}, source=source,
            dry_run=dry_run is not None, plan_options=dry_run,
        )  # fmt: skip
        if fingerprint is not None:
            request.input.lines, request.input.digest = fingerprint.lines, fingerprint.digest
        return self._call("CreateJob", request)

    def add_lines(
        self, job_id: str, lines: Iterable[bytes], skip: int | None = None
    ) -> pb.AddRequestsResponse:
        """Streams request lines into a VALIDATING job, in chunks of about 1 MiB; gRPC flow
        control paces the sender. Without `skip` they are added after the lines the job holds.
        With it, the lines from request line `skip` on (the first `skip` were sent before) are
        placed by position: those the job already holds are compared and skipped (an earlier or
        a concurrent upload's), never added twice; one that differs is refused (PlannerRejected,
        ALREADY_EXISTS)."""
        if skip is None:
            return self._call("AddRequests", _chunks(job_id, lines, None),
                              timeout=self._long(_UPLOAD_TIMEOUT_S))  # fmt: skip
        request_lines = (line for line in lines if is_request_line(line))
        chunks = _chunks(job_id, itertools.islice(request_lines, skip, None), skip)
        return self._call("AddRequests", chunks, timeout=self._long(_UPLOAD_TIMEOUT_S))

    def seal(self, job_id: str) -> pb.Job:
        return self._call("SealJob", pb.SealJobRequest(job_id=job_id))

    def get(self, job_id: str) -> pb.Job:
        return self._call("GetJob", pb.GetJobRequest(job_id=job_id))

    def list(self, limit: int = 100) -> list[pb.Job]:
        """The newest `limit` jobs, page by page."""
        jobs: list[pb.Job] = []
        token = ""
        while len(jobs) < limit:
            request = pb.ListJobsRequest(limit=min(limit - len(jobs), 1000), page_token=token)
            page = self._call("ListJobs", request)
            jobs += page.jobs
            token = page.next_page_token
            if not token:
                break
        return jobs

    def find_job(self, idempotency_key: str) -> pb.Job | None:
        """The job created with this key among the planner's newest 1000, or None."""
        return next((j for j in self.list(1000) if j.idempotency_key == idempotency_key), None)

    def watch(self, job_id: str) -> Iterator[pb.Job]:
        return self._stream("WatchJob", pb.WatchJobRequest(job_id=job_id), None)

    def cancel(self, job_id: str) -> pb.Job:
        return self._call("CancelJob", pb.CancelJobRequest(job_id=job_id))

    def queue_depth(self, model: str = "") -> pb.QueueDepth:
        """Groups waiting and leased over all jobs (of `model` when given)."""
        return self._call("GetQueueDepth", pb.GetQueueDepthRequest(model=model))

    def abandon_upload(self, job_id: str) -> pb.Job:
        """Fails a job whose upload broke before its seal, freeing its idempotency key (it ran
        nothing); a job sealed meanwhile comes back as it is."""
        request = pb.CancelJobRequest(job_id=job_id, upload_interrupted=True)
        return self._call("CancelJob", request)

    def submit_file(
        self,
        path: Path | str,
        model: str = "",
        idempotency_key: str = "",
        attempts: int = UPLOAD_ATTEMPTS,
    ) -> pb.Job:
        """The file's (or the object's, by URL) lines, submitted as `submit_lines` does."""
        return self.submit_lines(lambda: _file_lines(path), model, idempotency_key, attempts)

    def submit_lines(
        self,
        lines: Callable[[], Iterable[bytes]],
        model: str = "",
        idempotency_key: str = "",
        attempts: int = UPLOAD_ATTEMPTS,
    ) -> pb.Job:
        """Creates a job, streams `lines()` into it and seals it; returns the job.

        The job is created with the input's fingerprint (`lines()` is read once for it first), so
        one idempotency key gives one job holding the input once: a submit under a key whose job
        is sealed gets that job back without sending a line; one whose job still takes lines (an
        upload that broke, a client that died, another client submitting at once) sends the
        input again from its start, and the planner skips the lines it holds; a key used for
        another input is refused (PlannerRejected, ALREADY_EXISTS). When an upload breaks (a
        replica stopped: the channel reconnects, maybe to another replica) it is sent again, up
        to `attempts` uploads in all, each retry logging a warning; a job whose upload failed
        meanwhile (lines lost with a replica, Redis out of memory) freed its key, and the next
        attempt starts a clean job under it."""
        fingerprint = input_digest.fingerprint(_sent(line) for line in lines())
        reason = ""
        for attempt in range(1, attempts + 1):
            if attempt > 1:
                log.warning("%s; submitting the input again (attempt %d of %d)",
                            reason, attempt, attempts)  # fmt: skip
                time.sleep(_RETRY_PAUSE_S * (attempt - 1))
            try:
                job = self.create_job(model, idempotency_key, fingerprint=fingerprint)
                if job.state == pb.JOB_STATE_VALIDATING:
                    job = self._upload(job.id, lines)
                if job.error.code not in _UPLOAD_LOST:
                    return job
                reason = f"job {job.id} failed ({job.error.code}: {job.error.message})"
            except PlannerUnavailable as exc:
                reason = f"the upload broke ({exc})"
                if attempt == attempts:
                    raise
        raise PlannerUnavailable(
            grpc.StatusCode.UNAVAILABLE, f"{reason}; gave up after {attempts} uploads"
        )

    def _upload(self, job_id: str, lines: Callable[[], Iterable[bytes]]) -> pb.Job:
        """Sends the input into a job from its first line and seals it. A job that stopped taking
        lines meanwhile (sealed by another client under the same key, or failed) is answered as
        the seal finds it: a seal running elsewhere is waited for; a job that still lacks lines of
        the input is not sealed, and the refusal of the upload is raised."""
        try:
            self.add_lines(job_id, lines(), skip=0)
        except PlannerRejected as exc:
            if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            try:
                return self._seal_through_reconnects(job_id)
            except PlannerRejected:
                raise exc from None
        return self._seal_through_reconnects(job_id)

    def _seal_through_reconnects(self, job_id: str) -> pb.Job:
        """Seals the job, asking again (any replica seals any job) while the planner is away;
        a seal that found lines lost (ABORTED: the job failed) is not asked again."""
        for attempt in range(1, _SEAL_ATTEMPTS + 1):
            try:
                return self.seal(job_id)
            except PlannerUnavailable as exc:
                if attempt == _SEAL_ATTEMPTS or exc.code == grpc.StatusCode.ABORTED:
                    raise
                time.sleep(_RETRY_PAUSE_S * attempt)
        raise AssertionError("the last attempt returns or raises")

    # --- results ------------------------------------------------------------------------------
    def results(
        self,
        job_id: str,
        offset: int = 0,
        kind: pb.ResultKind = pb.RESULT_KIND_ALL,
        follow: bool = False,
        unanswered: bool = False,
    ) -> Iterator[pb.ResultLine]:
        """`unanswered`: a finished job's requests never answered come as error lines too."""
        request = pb.StreamResultsRequest(
            job_id=job_id, offset=offset, kind=kind, follow=follow, unanswered=unanswered
        )
        return self._stream("StreamResults", request, None if follow else self._long())

    def download(self, job_id: str, output: Path | str, errors: Path | str) -> tuple[int, int]:
        """Follows the job, writing its output and error files (download.py); returns the lines
        each holds. An interrupted download goes on where it can verify what it wrote, else starts
        over; a marker of another job is refused (ValueError), a link at any path too."""

        def results(offset: int) -> Iterator[pb.ResultLine]:
            return self.results(job_id, offset, pb.RESULT_KIND_ALL, follow=True)

        return download_results(results, job_id, output, errors)

    def write_results(self, job_id: str, output: Path, errors: Path) -> tuple[int, int]:
        """Writes the outputs and the errors of a finished job, in input order, each file replaced
        whole so a retry never leaves a half-written one; returns (outputs, errors) written. A
        link at `output` or `errors` is replaced, its target untouched (output_files.replaced)."""
        written = []
        for kind, path in ((pb.RESULT_KIND_OUTPUT, output), (pb.RESULT_KIND_ERROR, errors)):
            count = 0
            with replaced(path) as out:
                for line in self.results(job_id, 0, kind):
                    out.write(line.line.encode() + b"\n")
                    count += 1
            written.append(count)
        return written[0], written[1]

    def _long(self, floor: float = _RESULTS_TIMEOUT_S) -> float | None:
        """The deadline of a call that moves a whole job: at least `floor`, none without one."""
        return None if self._timeout is None else max(self._timeout, floor)


def _file_lines(path: Path | str) -> Iterator[bytes]:
    """In bounded memory: a line over any planner's limit is never held whole (input_lines.py)."""
    with open_source(path) as f:
        yield from bounded_lines(f, MAX_LINE_BYTES_LIMIT)


def _sent(line: bytes) -> bytes:
    """A line as it is sent: one over any planner's limit is cut there, so it fails alone
    (line_too_large)."""
    return line[: MAX_LINE_BYTES_LIMIT + 1]


def _chunks(
    job_id: str, lines: Iterable[bytes], first_line: int | None
) -> Iterator[pb.AddRequestsChunk]:
    """Lines in chunks; placed from request line `first_line` on when given (the first chunk
    says where). An empty input still sends one chunk, so the planner learns of the job at seal
    time."""
    batch: list[bytes] = []
    size = 0
    placed = False
    for line in lines:
        line = _sent(line)
        batch.append(line)
        size += len(line)
        if size >= _CHUNK_BYTES:
            yield _chunk(job_id, batch, None if placed else first_line)
            batch, size, placed = [], 0, True
    yield _chunk(job_id, batch, None if placed else first_line)


def _chunk(job_id: str, lines: list[bytes], first_line: int | None) -> pb.AddRequestsChunk:
    chunk = pb.AddRequestsChunk(job_id=job_id, lines=lines)
    if first_line is not None:
        chunk.first_line = first_line
    return chunk


_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    # what a request stream broken on our side (an input file unreadable midway) ends with
    grpc.StatusCode.CANCELLED,
    # a wrong token is the caller's configuration, not the job's fault: wait for it to be fixed
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
}


def _translate(exc: grpc.RpcError, method: str) -> PlannerError:
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    message = f"planner {method}: {code.name}: {detail}"
    if code in _RETRYABLE:
        return PlannerUnavailable(code, message)
    return PlannerRejected(code, message)
