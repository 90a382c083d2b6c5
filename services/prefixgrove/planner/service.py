"""The Planner gRPC service: jobs in, groups queued, status and results out."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence

import grpc

from prefixgrove.jobs.ingest import JobIngestor, JobPlan, UploadClosed, UploadCounts, job_error
from prefixgrove.jobs.line_parser import LineParser, LineRules
from prefixgrove.jobs.redis_store.schema import JobRecord, JobState, ResultRecord
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.jobs.redis_store.uploads import Uploads, rebuild_plan
from prefixgrove.jobs.tokenize import PromptTokenizer
from prefixgrove.planner.metrics import PlannerMetrics
from prefixgrove.settings import IngestSettings, ServedModel
from prefixgrove_proto import planner_pb2 as pb
from prefixgrove_proto import planner_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_POLL_S = 0.25
_STORE_WAIT_S = 10.0  # how long a seal waits for lines other streams took and still write
_SEAL_WAIT_S = 30.0  # how long a second SealJob waits for the seal running elsewhere
# Results are read from Redis a window at a time, sized to about _RESULT_WINDOW_BYTES by the
# lines of the last window (logprobs lines run to hundreds of KB, plain ones to a few hundred
# bytes), so a stream holds a few MB whatever the lines, and the first window is small.
_RESULT_WINDOW = 512
_FIRST_RESULT_WINDOW = 16
_RESULT_WINDOW_BYTES = 4 << 20
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
    """This replica's cache of a job streaming in: the prefix index of the lines it took (the
    whole job's when every stream went through here), and a lock so its streams take turns."""

    def __init__(self, ingestor: JobIngestor) -> None:
        self.ingestor = ingestor
        self.lock = threading.Lock()


class PlannerService(pb_grpc.PlannerServicer):
    """Any replica serves any call of any job: an upload's state is in Redis (jobs/redis_store/uploads.py), so
    a job may be created on one replica, take lines through several and be sealed on another."""

    def __init__(
        self,
        store: JobStore,
        models: Sequence[ServedModel],
        ingest: IngestSettings,
        metrics: PlannerMetrics,
        parser: LineParser | None = None,
    ) -> None:
        """`parser`: parses uploaded lines (in processes of its own); default: in this process."""
        self.store = store
        self.parser = parser or LineParser(
            LineRules(ingest.max_line_bytes, ingest.default_max_tokens)
        )
        self.uploads = Uploads(store.r)
        self.models = {m.name: m.source for m in models}  # served name -> tokenizer source
        self.default_model = models[0].name
        self.ingest_settings = ingest
        self.metrics = metrics
        metrics.declare_models(self.models)
        metrics.follow_jobs(store.get_job)
        self._tokenizers: dict[str, PromptTokenizer] = {}  # by source: two names may share one
        self._ingests: dict[str, _Ingest] = {}
        self._sealing: set[str] = set()  # jobs this replica seals right now
        self._lock = threading.Lock()
        self.instance = uuid.uuid4().hex[:12]

    def heartbeat(self, ttl_s: int) -> None:
        self.store.heartbeat(self.instance, ttl_s)

    def recover(self) -> None:
        """At start: fails the uploads of planners that stopped, and indexes and trims the queues."""
        self.fail_orphaned_uploads()
        self.store.index_active_jobs()
        self.store.trim_queues()

    def fail_orphaned_uploads(self) -> list[str]:
        """Fails the jobs whose planner stopped while it took their input or sealed them: a
        stream it had open may have lost lines. Other planners' jobs (a rolling update, another
        replica) are left alone. Returns the jobs failed."""
        failed = []
        for job_id in self.store.orphaned_ingests():
            if self.store.job_state(job_id) == JobState.VALIDATING:
                message = (
                    "the planner stopped while the input was streaming in; submit the job again"
                )
                self.store.fail_ingest(job_id, "ingest_interrupted", message)
                log.warning("job %s failed: its planner stopped during the upload", job_id)
                failed.append(job_id)
            self._end_upload(job_id)
        return failed

    def expire_idle_uploads(self, idle_s: float, now: float | None = None) -> list[str]:
        """Fails the jobs whose input stopped arriving `idle_s` before `now` (unix seconds)
        without a seal (the client went away), whichever replica took their lines: their lines
        leave Redis, their keys free. Returns them."""
        now = time.time() if now is None else now
        expired = []
        for job_id in self.uploads.open_jobs():
            if not self.uploads.claim_idle(job_id, idle_s, now):
                continue
            message = f"no input arrived for {idle_s:.0f}s and the job was never sealed"
            self.store.abandon_upload(job_id, message)
            self._end_upload(job_id)
            log.warning("job %s failed: its upload was abandoned", job_id)
            expired.append(job_id)
        return expired

    def forget_ended_uploads(self) -> None:
        """Drops the cached index of each job whose upload another replica ended (sealed,
        cancelled, failed)."""
        with self._lock:
            cached = list(self._ingests)
        for job_id in cached:
            if not self.uploads.is_open(job_id):
                with self._lock:
                    self._ingests.pop(job_id, None)

    # --- jobs -------------------------------------------------------------------------------
    def CreateJob(self, request: pb.CreateJobRequest, context: grpc.ServicerContext) -> pb.Job:
        model = request.model or self.default_model
        if model not in self.models:
            # NOTE: refused by name alone, before anything is looked up on disk, so the message
            # says nothing about the planner's files.
            served = ", ".join(repr(m) for m in self.models)
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"model_not_found: model {model!r} is not served here; this planner and its "
                f"workers serve {served} (leave the model out to use {self.default_model!r})",
            )
        _check_metadata(request.metadata, context)
        self._tokenizers_of(context)  # refused now rather than at the first lines
        job, created = self.store.create_job(model, request.idempotency_key, dict(request.metadata))
        if created:
            # claimed first: should this planner stop before the upload opens, others fail the job
            self.store.claim_ingest(job.id, self.instance)
            self.uploads.open(job.id)
            self.metrics.jobs_created.labels(model).inc()
            log.info("created job %s for model %s", job.id, model)
        return job_to_pb(job, self.store)

    def AddRequests(
        self, request_iterator: Iterator[pb.AddRequestsChunk], context: grpc.ServicerContext
    ) -> pb.AddRequestsResponse:
        accepted = rejected = 0
        ingest: _Ingest | None = None
        job_id = ""
        try:
            for chunk in request_iterator:
                if ingest is None:
                    job_id = chunk.job_id
                    ingest = self._open_ingest(job_id, context)
                with ingest.lock:
                    ing = ingest.ingestor
                    batch = ing.add(chunk.lines)
                    self.store.write_requests(job_id, batch, ing.total, ing.prompt_tokens)
                accepted += len(batch.requests)
                rejected += len(batch.errors)
                self.metrics.count_lines(batch, ing.model_of, ing.default_model)
        except UploadClosed as exc:
            self._forget_ingest(job_id)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        finally:
            if job_id:  # lines written after the job ended (cancelled meanwhile) go with it
                self.uploads.drop_unsealed_requests(job_id)
        total = ingest.ingestor.total if ingest else 0
        return pb.AddRequestsResponse(accepted=accepted, rejected=rejected, total=total)

    def SealJob(self, request: pb.SealJobRequest, context: grpc.ServicerContext) -> pb.Job:
        job = self._job(request.job_id, context)
        if job.state != JobState.VALIDATING:
            return job_to_pb(job, self.store)  # sealing twice is harmless
        with self._lock:
            busy = job.id in self._sealing
            self._sealing.add(job.id)
        if busy:
            return job_to_pb(self._sealed_elsewhere(job.id, self.instance, context), self.store)
        try:
            claim = self.uploads.claim_seal(job.id, self.instance)
            if claim.counts is None:
                return job_to_pb(self._sealed_elsewhere(job.id, claim.holder, context), self.store)
            self.store.claim_ingest(job.id, self.instance)  # if we stop now, others fail the job
            self.metrics.job_sealed(job.id)
            self._seal(job, claim.counts, context)
        finally:
            with self._lock:
                self._sealing.discard(job.id)
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
        if request.upload_interrupted:
            return job_to_pb(self._interrupt_upload(job), self.store)
        if job.state.terminal:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"job {job.id} is already {job.state.value}"
            )
        state = self.store.cancel(job.id)
        if job.state == JobState.VALIDATING:  # cancelled while streaming in: no more lines
            self._end_upload(job.id)
            self.uploads.drop_unsealed_requests(job.id)
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
        window = _FIRST_RESULT_WINDOW
        while context.is_active():
            job = self._job(job.id, context)
            if job.state != JobState.VALIDATING and index >= job.total:
                return
            results = self.store.read_results(job.id, index, window)
            window = _next_window(results)
            for result in results:
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
        """This replica's cache of the job, made on its first lines here; the job is ours now."""
        job = self._job(job_id, context)
        if job.state != JobState.VALIDATING or not self.uploads.is_open(job_id):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"job {job_id} no longer takes requests: it is {job.state.value}",
            )
        tokenizers = self._tokenizers_of(context)
        with self._lock:
            ingest = self._ingests.get(job_id)
            if ingest is None:
                ledger = self.uploads.ledger(job_id)
                ingestor = JobIngestor(tokenizers, self.ingest_settings, ledger, self.parser,
                                       default_model=job.model)  # fmt: skip
                ingest = self._ingests[job_id] = _Ingest(ingestor)
        self.store.claim_ingest(job_id, self.instance)
        return ingest

    def _seal(self, job: JobRecord, counts: UploadCounts, context: grpc.ServicerContext) -> None:
        """Groups the job and queues its groups; fails it (and the call) when its input is not
        a batch or lost lines."""
        error = job_error(counts)
        if error is not None:
            self.store.fail_ingest(job.id, *error)  # failed before its upload ends: a seal
            self._end_upload(job.id)  # elsewhere finds the job ended, not an upload gone
            code = (
                grpc.StatusCode.FAILED_PRECONDITION
                if error[0] == "empty_file"
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            context.abort(code, f"job {job.id} failed: {error[1]}")
        if not self._all_lines_stored(job.id, counts.lines):
            message = (
                "lines of the input were taken but never stored (a planner stopped while it "
                "took them); submit the job again"
            )
            self.store.fail_ingest(job.id, "ingest_interrupted", message)
            self._end_upload(job.id)
            context.abort(grpc.StatusCode.ABORTED, f"job {job.id} failed: {message}")
        start = time.perf_counter()
        plans, path = self._plan(job, counts.lines)
        self.uploads.write_totals(job.id, counts)
        if self.store.job_state(job.id) == JobState.VALIDATING:
            self.store.queue_plans(job.id, plans)
        else:
            self.store.cancel(job.id)  # cancelled while streaming in: nothing to queue
        self._end_upload(job.id)
        units = {model: len(plan.units) for model, plan in plans.items()}
        saved = sum(plan.prefix_tokens_saved for plan in plans.values())
        log.info("sealed job %s: units %s, %d tokens saved, grouped (%s) in %.2fs", job.id,
                 units, saved, path, time.perf_counter() - start)  # fmt: skip

    def _plan(self, job: JobRecord, lines: int) -> tuple[dict[str, JobPlan], str]:
        """The job's plan per model, and how it was built: from this replica's indexes when
        every request came through here, else from the request records in Redis."""
        with self._lock:
            ingest = self._ingests.get(job.id)
        if ingest is not None:
            with ingest.lock:
                if len(ingest.ingestor) == self.uploads.request_count(job.id):
                    return ingest.ingestor.plan(), "cached index"
        settings = self.ingest_settings
        return rebuild_plan(self.uploads, job.id, lines, settings, job.model), "rebuilt index"

    def _all_lines_stored(self, job_id: str, lines: int) -> bool:
        """Waits a little for streams still writing lines they took before the seal."""
        deadline = time.monotonic() + _STORE_WAIT_S
        while self.uploads.stored(job_id) < lines:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S / 5)
        return True

    def _sealed_elsewhere(
        self, job_id: str, holder: str, context: grpc.ServicerContext
    ) -> JobRecord:
        """The job once the seal another call runs (here or on `holder`) has ended it."""
        deadline = time.monotonic() + _SEAL_WAIT_S
        while context.is_active() and time.monotonic() < deadline:
            job = self._job(job_id, context)
            if job.state != JobState.VALIDATING:
                return job
            if not holder:  # no upload open and no seal running: nothing will seal it
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"job {job_id} has no upload open to seal (its input is gone)",
                )
            time.sleep(_POLL_S)
        context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"job {job_id} is being sealed by planner {holder}; ask again",
        )
        raise AssertionError("abort raises")  # for the type checker

    def _interrupt_upload(self, job: JobRecord) -> JobRecord:
        """The client's upload broke: a job never sealed fails, freeing its idempotency key for
        the new job the client makes; a job sealed meanwhile is left as it is."""
        if job.state == JobState.VALIDATING:
            message = "the upload broke before the seal; the client submitted the input again"
            self.store.fail_ingest(job.id, "ingest_interrupted", message)
            self._end_upload(job.id)
            self.uploads.drop_unsealed_requests(job.id)
            log.warning("job %s failed: its client's upload broke", job.id)
        return self.store.get_job(job.id) or job

    def _end_upload(self, job_id: str) -> None:
        self._forget_ingest(job_id)
        self.uploads.close(job_id)
        self.store.release_ingest(job_id)

    def _forget_ingest(self, job_id: str) -> None:
        with self._lock:
            self._ingests.pop(job_id, None)

    def _tokenizers_of(self, context: grpc.ServicerContext) -> dict[str, PromptTokenizer]:
        """Every served model's tokenizer by served name (a job's lines may name any of them),
        each source loaded once."""
        return {name: self._tokenizer(name, source, context) for name, source in self.models.items()}  # fmt: skip

    def _tokenizer(self, name: str, source: str, context: grpc.ServicerContext) -> PromptTokenizer:
        with self._lock:
            if source not in self._tokenizers:
                try:
                    self._tokenizers[source] = PromptTokenizer(
                        source, self.ingest_settings.max_model_len
                    )
                except (ValueError, OSError):
                    log.exception("the tokenizer of model %r (%s) did not load", name, source)
                    context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"model {name!r} cannot be served: its tokenizer did not load "
                        "(the planner's log says why)",
                    )
            return self._tokenizers[source]


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


def _next_window(results: list[ResultRecord | None]) -> int:
    """How many results to read next: about _RESULT_WINDOW_BYTES of lines like these."""
    lines = [len(r.line) for r in results if r is not None]
    if not lines:
        return _RESULT_WINDOW
    return max(1, min(_RESULT_WINDOW, _RESULT_WINDOW_BYTES * len(lines) // max(sum(lines), 1)))
