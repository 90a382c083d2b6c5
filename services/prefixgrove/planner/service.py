"""The Planner gRPC service: jobs in, groups queued, status and results out."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator, Mapping

import grpc

from prefixgrove.jobs.ingest import JobIngestor
from prefixgrove.jobs.schema import JobRecord, JobState
from prefixgrove.jobs.store import JobStore
from prefixgrove.jobs.tokenize import PromptTokenizer
from prefixgrove.planner.metrics import PlannerMetrics
from prefixgrove.settings import IngestSettings
from prefixgrove_proto import planner_pb2 as pb
from prefixgrove_proto import planner_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_POLL_S = 0.25
_RESULT_WINDOW = 512
_MAX_PAGE = 1000  # jobs in one ListJobs answer
_MAX_METADATA_ENTRIES = 64
_MAX_METADATA_BYTES = 16 << 10
# NOTE: the proto's JOB_STATE_FINALIZING has no JobState: results are final as workers write them.
_PB_STATES = {
    JobState.VALIDATING: pb.JOB_STATE_VALIDATING,
    JobState.IN_PROGRESS: pb.JOB_STATE_IN_PROGRESS,
    JobState.COMPLETED: pb.JOB_STATE_COMPLETED,
    JobState.FAILED: pb.JOB_STATE_FAILED,
    JobState.CANCELLING: pb.JOB_STATE_CANCELLING,
    JobState.CANCELLED: pb.JOB_STATE_CANCELLED,
}


def job_to_pb(job: JobRecord, store: JobStore) -> pb.Job:
    queue = store.job_queue(job)
    return pb.Job(
        id=job.id,
        idempotency_key=job.idempotency_key,
        model=job.model,
        state=_PB_STATES[job.state],
        request_counts=pb.RequestCounts(
            total=job.total, completed=job.completed, failed=job.failed
        ),
        queue=pb.QueueDepth(
            groups_waiting=queue.waiting, groups_leased=queue.leased, depth=queue.depth
        ),
        groups_total=job.groups_total,
        groups_done=job.groups_done,
        prefix_tokens_saved=job.prefix_tokens_saved,
        prompt_tokens=job.prompt_tokens,
        completion_tokens=job.completion_tokens,
        created_at=job.created_at,
        in_progress_at=job.in_progress_at,
        finished_at=job.finished_at,
        error=pb.JobError(code=job.error_code, message=job.error_message)
        if job.error_code
        else None,
        metadata=job.metadata,
    )


class _Ingest:
    """A job being streamed in; one lock so concurrent AddRequests streams take turns."""

    def __init__(self, ingestor: JobIngestor) -> None:
        self.ingestor = ingestor
        self.lock = threading.Lock()
        self.touched = time.monotonic()  # when its last lines arrived


class PlannerService(pb_grpc.PlannerServicer):
    def __init__(
        self, store: JobStore, default_model: str, ingest: IngestSettings, metrics: PlannerMetrics
    ) -> None:
        self.store = store
        self.default_model = default_model
        self.ingest_settings = ingest
        self.metrics = metrics
        self._tokenizers: dict[str, PromptTokenizer] = {}
        self._ingests: dict[str, _Ingest] = {}
        self._lock = threading.Lock()
        self.instance = uuid.uuid4().hex[:12]

    def heartbeat(self, ttl_s: int) -> None:
        self.store.heartbeat(self.instance, ttl_s)

    def recover(self) -> None:
        """A job whose planner stopped while its input streamed in cannot be sealed: the lines it
        had taken in are gone with it. Other planners' jobs (a rolling update) are left alone."""
        for job_id in self.store.orphaned_ingests():
            if self.store.job_state(job_id) == JobState.VALIDATING:
                message = (
                    "the planner stopped while the input was streaming in; submit the job again"
                )
                self.store.fail_ingest(job_id, "ingest_interrupted", message)
                log.warning("job %s failed: its planner stopped during the upload", job_id)
            self.store.release_ingest(job_id)
        self.store.index_active_jobs()
        self.store.trim_queues()

    def expire_idle_uploads(self, idle_s: float, now: float | None = None) -> list[str]:
        """Fails the jobs whose input stopped arriving `idle_s` ago without a seal (the client went
        away): their lines leave this planner's memory and Redis, their keys free. Returns them."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [j for j, ing in self._ingests.items() if now - ing.touched >= idle_s]
        expired = []
        for job_id in idle:
            with self._lock:
                ingest = self._ingests.get(job_id)
            if ingest is None or not ingest.lock.acquire(blocking=False):
                continue  # sealed meanwhile, or lines arriving right now
            try:
                self._drop_ingest(job_id)
                message = f"no input arrived for {idle_s:.0f}s and the job was never sealed"
                self.store.abandon_upload(job_id, message)
            finally:
                ingest.lock.release()
            log.warning("job %s failed: its upload was abandoned", job_id)
            expired.append(job_id)
        return expired

    # --- jobs -------------------------------------------------------------------------------
    def CreateJob(self, request: pb.CreateJobRequest, context: grpc.ServicerContext) -> pb.Job:
        model = request.model or self.default_model
        if model != self.default_model:
            # NOTE: refused by name alone, before anything is looked up on disk, so the message
            # says nothing about the planner's files.
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"model_not_found: model {model!r} is not served here; this planner and its "
                f"workers serve {self.default_model!r} (leave the model out to use it)",
            )
        _check_metadata(request.metadata, context)
        tokenizer = self._tokenizer(model, context)
        job, created = self.store.create_job(model, request.idempotency_key, dict(request.metadata))
        if created:
            with self._lock:
                self._ingests[job.id] = _Ingest(JobIngestor(tokenizer, self.ingest_settings))
            self.store.claim_ingest(job.id, self.instance)
            self.metrics.jobs_created.inc()
            log.info("created job %s for model %s", job.id, model)
        return job_to_pb(job, self.store)

    def AddRequests(
        self, request_iterator: Iterator[pb.AddRequestsChunk], context: grpc.ServicerContext
    ) -> pb.AddRequestsResponse:
        accepted = rejected = 0
        ingest: _Ingest | None = None
        job_id = ""
        for chunk in request_iterator:
            if ingest is None:
                job_id = chunk.job_id
                ingest = self._open_ingest(job_id, context)
            with ingest.lock:
                ingest.touched = time.monotonic()
                ing = ingest.ingestor
                batch = ing.add(chunk.lines)
                self.store.write_requests(job_id, batch, ing.total, ing.prompt_tokens)
            accepted += len(batch.requests)
            rejected += len(batch.errors)
            self.metrics.requests_accepted.inc(len(batch.requests))
            self.metrics.requests_rejected.inc(len(batch.errors))
        total = ingest.ingestor.total if ingest else 0
        return pb.AddRequestsResponse(accepted=accepted, rejected=rejected, total=total)

    def SealJob(self, request: pb.SealJobRequest, context: grpc.ServicerContext) -> pb.Job:
        job = self._job(request.job_id, context)
        if job.state != JobState.VALIDATING:
            return job_to_pb(job, self.store)  # sealing twice is harmless
        ingest = self._open_ingest(job.id, context)
        with ingest.lock:
            error = ingest.ingestor.job_error()
            if error is not None:
                self._drop_ingest(job.id)
                self.store.fail_ingest(job.id, *error)
                code = (
                    grpc.StatusCode.FAILED_PRECONDITION
                    if error[0] == "empty_file"
                    else grpc.StatusCode.INVALID_ARGUMENT
                )
                context.abort(code, f"job {job.id} failed: {error[1]}")
            start = time.perf_counter()
            plan = ingest.ingestor.plan()
            self._drop_ingest(job.id)
        if self.store.job_state(job.id) == JobState.VALIDATING:
            self.store.queue_plan(job.id, job.model, plan)
        else:
            self.store.cancel(job.id)  # cancelled while streaming in: nothing to queue
        log.info("sealed job %s: %d units, %d tokens saved, grouped in %.2fs",
                 job.id, len(plan.units), plan.prefix_tokens_saved, time.perf_counter() - start)  # fmt: skip
        return job_to_pb(self._job(job.id, context), self.store)

    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> pb.Job:
        return job_to_pb(self._job(request.job_id, context), self.store)

    def ListJobs(
        self, request: pb.ListJobsRequest, context: grpc.ServicerContext
    ) -> pb.ListJobsResponse:
        limit = min(request.limit or 100, _MAX_PAGE)
        start = _page_start(request.page_token, context)
        jobs, more = self.store.list_jobs(limit, start)
        return pb.ListJobsResponse(
            jobs=[job_to_pb(j, self.store) for j in jobs],
            next_page_token=str(start + limit) if more else "",
        )

    def WatchJob(
        self, request: pb.WatchJobRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.Job]:
        last: pb.Job | None = None
        while context.is_active():
            current = job_to_pb(self._job(request.job_id, context), self.store)
            if current != last:
                yield current
                last = current
            state = self.store.job_state(request.job_id)
            if state is None or state.terminal:  # gone (expired, or Redis lost it) or done
                return
            time.sleep(_POLL_S)

    def CancelJob(self, request: pb.CancelJobRequest, context: grpc.ServicerContext) -> pb.Job:
        job = self._job(request.job_id, context)
        if job.state.terminal:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"job {job.id} is already {job.state.value}"
            )
        state = self.store.cancel(job.id)
        self._drop_ingest(job.id)  # a job cancelled while streaming in takes no more lines
        log.info("cancel requested for job %s: now %s", job.id, state.value)
        return job_to_pb(self._job(job.id, context), self.store)

    def GetQueueDepth(
        self, request: pb.GetQueueDepthRequest, context: grpc.ServicerContext
    ) -> pb.QueueDepth:
        depth = self.store.model_queue(request.model or None)
        return pb.QueueDepth(
            groups_waiting=depth.waiting, groups_leased=depth.leased, depth=depth.depth
        )

    # --- results ----------------------------------------------------------------------------
    def StreamResults(
        self, request: pb.StreamResultsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ResultLine]:
        job = self._job(request.job_id, context)
        if request.offset < 0:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"offset must be >= 0, got {request.offset}"
            )
        kind = request.kind or pb.RESULT_KIND_OUTPUT
        index = request.offset
        while context.is_active():
            job = self._job(job.id, context)
            if job.state != JobState.VALIDATING and index >= job.total:
                return
            for result in self.store.read_results(job.id, index, _RESULT_WINDOW):
                if result is None:
                    if not job.state.terminal:
                        break
                    # never answered (a cancelled or failed job): nothing to send
                elif kind == pb.RESULT_KIND_ALL or result.is_error == (
                    kind == pb.RESULT_KIND_ERROR
                ):
                    yield pb.ResultLine(index=index, is_error=result.is_error, line=result.line)
                index += 1
            else:
                continue
            if not request.follow:
                return
            time.sleep(_POLL_S)

    # --- helpers ----------------------------------------------------------------------------
    def _job(self, job_id: str, context: grpc.ServicerContext) -> JobRecord:
        job = self.store.get_job(job_id) if job_id else None
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"job {job_id!r} does not exist")
        return job  # type: ignore[return-value]

    def _open_ingest(self, job_id: str, context: grpc.ServicerContext) -> _Ingest:
        job = self._job(job_id, context)
        with self._lock:
            ingest = self._ingests.get(job_id)
        if ingest is None or job.state != JobState.VALIDATING:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"job {job_id} no longer takes requests: it is {job.state.value}",
            )
        return ingest  # type: ignore[return-value]

    def _drop_ingest(self, job_id: str) -> None:
        with self._lock:
            self._ingests.pop(job_id, None)
        self.store.release_ingest(job_id)

    def _tokenizer(self, model: str, context: grpc.ServicerContext) -> PromptTokenizer:
        with self._lock:
            if model not in self._tokenizers:
                try:
                    self._tokenizers[model] = PromptTokenizer(
                        model, self.ingest_settings.max_model_len
                    )
                except (ValueError, OSError):
                    log.exception("the tokenizer of model %r did not load", model)
                    context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"model {model!r} cannot be served: its tokenizer did not load "
                        "(the planner's log says why)",
                    )
            return self._tokenizers[model]


def _page_start(token: str, context: grpc.ServicerContext) -> int:
    """A page token is the position of the page's first job in the newest-first list."""
    if not token:
        return 0
    if not token.isdigit():
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"page_token {token!r} is not one we gave")
    return int(token)


def _check_metadata(metadata: Mapping[str, str], context: grpc.ServicerContext) -> None:
    """Metadata travels with every status and list answer: it stays small."""
    size = sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items())
    if len(metadata) > _MAX_METADATA_ENTRIES or size > _MAX_METADATA_BYTES:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"metadata of {len(metadata)} entries and {size} bytes is too large: at most "
            f"{_MAX_METADATA_ENTRIES} entries and {_MAX_METADATA_BYTES} bytes of keys and values",
        )
