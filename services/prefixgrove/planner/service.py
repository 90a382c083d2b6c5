"""The Planner gRPC service: jobs in, groups queued, status and results out.

Each call is answered here; what a call needs beyond a few lines lives beside it: this replica's
uploads in ingests.py, the seal in sealing.py, the results stream in results.py, and a job as the
calls find and answer it in job_messages.py.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

import grpc

from prefixgrove.jobs.ingest import UploadClosed
from prefixgrove.jobs.line_parser import LineParser, LineRules
from prefixgrove.jobs.redis_store.schema import JobRecord, JobState
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.jobs.redis_store.uploads import Uploads
from prefixgrove.planner.dry_runs import plan_options
from prefixgrove.planner.ingests import Ingests, UploadStream
from prefixgrove.planner.job_messages import (
    POLL_S,
    find_job,
    job_to_pb,
    queue_depth_to_pb,
    without_eta,
)
from prefixgrove.planner.metrics import PlannerMetrics
from prefixgrove.planner.object_inputs import ObjectInputs
from prefixgrove.planner.results import stream_results
from prefixgrove.planner.sealing import Sealer
from prefixgrove.settings import IngestSettings, ServedModel
from prefixgrove_proto import planner_pb2 as pb
from prefixgrove_proto import planner_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
_MAX_PAGE = 1000  # jobs in one ListJobs answer
_DEFAULT_PAGE = 100
_MAX_TOKEN_DIGITS = 15  # a position in the list of jobs, and far from Redis' integer bounds
_MAX_QUOTED = 200  # characters of a value a message quotes
_MAX_METADATA_ENTRIES = 64
_MAX_METADATA_BYTES = 16 << 10


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
        self.aliases = {alias: m.name for m in models for alias in m.aliases}
        self.default_model = models[0].name
        self.ingest_settings = ingest
        self.metrics = metrics
        metrics.declare_models(self.models)
        metrics.follow_jobs(store.get_job)
        self.instance = uuid.uuid4().hex[:12]
        self.ingests = Ingests(store, self.uploads, self.models, ingest, self.parser, self.instance,
                               self.aliases)  # fmt: skip
        self.sealer = Sealer(self.ingests, metrics)
        self.object_inputs = ObjectInputs(self)

    def heartbeat(self, ttl_s: int) -> None:
        self.store.heartbeat(self.instance, ttl_s)

    def recover(self) -> None:
        """At start: fails the uploads of planners that stopped, and indexes and trims the queues."""
        self.fail_orphaned_uploads()
        self.store.index_active_jobs()
        self.store.trim_queues()

    def fail_orphaned_uploads(self) -> list[str]:
        return self.ingests.fail_orphaned()

    def expire_idle_uploads(self, idle_s: float, now: float | None = None) -> list[str]:
        return self.ingests.expire_idle(idle_s, now)

    def forget_ended_uploads(self) -> None:
        self.ingests.forget_ended()

    # --- jobs -------------------------------------------------------------------------------
    def CreateJob(self, request: pb.CreateJobRequest, context: grpc.ServicerContext) -> pb.Job:
        model = request.model or self.default_model
        model = self.aliases.get(model, model)  # a job names its model by any of its names
        if model not in self.models:
            # NOTE: refused by name alone, before anything is looked up on disk, so the message
            # says nothing about the planner's files.
            served = ", ".join(repr(m) for m in self.models)
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"model_not_found: model {_quoted(model)} is not served here; this planner and "
                f"its workers serve {served} (leave the model out to use {self.default_model!r})",
            )
        _check_metadata(request.metadata, context)
        if request.HasField("source"):
            self.object_inputs.check(request.source, context)
        self.ingests.tokenizers(context)  # refused now rather than at the first lines
        options = plan_options(request.plan_options, context) if request.dry_run else None
        fingerprint = request.input
        job, created = self.ingests.create(model, request.idempotency_key, dict(request.metadata),
                                           fingerprint.lines, fingerprint.digest, context)  # fmt: skip
        if created and options is not None:  # marked before any line can seal it
            job = replace(job, dry_run=self.sealer.dry_runs.mark(job.id, options))
        if created:
            self.metrics.jobs_created.labels(model).inc()
            log.info("created job %s for model %s", job.id, model)
            if request.HasField("source"):  # the planner reads the input: nobody uploads it
                self.object_inputs.start(job.id, request.source)
        return job_to_pb(job, self.store)

    def AddRequests(
        self, request_iterator: Iterator[pb.AddRequestsChunk], context: grpc.ServicerContext
    ) -> pb.AddRequestsResponse:
        accepted = rejected = 0
        ingest: UploadStream | None = None
        job_id = ""
        try:
            for chunk in request_iterator:
                if ingest is None:
                    job_id = chunk.job_id
                    first_line = chunk.first_line if chunk.HasField("first_line") else None
                    ingest = self.ingests.open(self._job(job_id, context), context, first_line)
                batch = ingest.add(chunk.lines, self.store)
                accepted += len(batch.requests)
                rejected += len(batch.errors)
                ing = ingest.ingestor
                self.metrics.count_lines(batch, ing.model_of, ing.default_model)
        except UploadClosed as exc:
            self.ingests.forget(job_id)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        finally:
            if job_id:  # lines written after the job ended (cancelled meanwhile) go with it
                self.uploads.drop_unsealed_requests(job_id)
        total = ingest.ingestor.total if ingest else 0
        return pb.AddRequestsResponse(accepted=accepted, rejected=rejected, total=total)

    def SealJob(self, request: pb.SealJobRequest, context: grpc.ServicerContext) -> pb.Job:
        return self.sealer.seal(request.job_id, context)

    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> pb.Job:
        return job_to_pb(self._job(request.job_id, context), self.store)

    def ListJobs(
        self, request: pb.ListJobsRequest, context: grpc.ServicerContext
    ) -> pb.ListJobsResponse:
        limit = _page_size(request.limit, context)
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
            seen = without_eta(current)  # the ETA moves with the clock: not a change
            if seen != last:
                yield current
                last = seen
            state = self.store.job_state(request.job_id)
            if state is None or state.terminal:  # gone (expired, or Redis lost it) or done
                return
            time.sleep(POLL_S)

    def CancelJob(self, request: pb.CancelJobRequest, context: grpc.ServicerContext) -> pb.Job:
        job = self._job(request.job_id, context)
        if request.upload_interrupted:
            return job_to_pb(self.ingests.interrupt(job), self.store)
        if job.state.terminal:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"job {job.id} is already {job.state.value}"
            )
        state = self.store.cancel(job.id)
        if job.state == JobState.VALIDATING:  # cancelled while streaming in: no more lines
            self.ingests.end(job.id)
            self.uploads.drop_unsealed_requests(job.id)
        log.info("cancel requested for job %s: now %s", job.id, state.value)
        return job_to_pb(self._job(job.id, context), self.store)

    def GetQueueDepth(
        self, request: pb.GetQueueDepthRequest, context: grpc.ServicerContext
    ) -> pb.QueueDepth:
        model = self.aliases.get(request.model, request.model)
        return queue_depth_to_pb(self.store.model_queue(model or None))

    # --- results ----------------------------------------------------------------------------
    def StreamResults(
        self, request: pb.StreamResultsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ResultLine]:
        return stream_results(self.store, request, context)

    def _job(self, job_id: str, context: grpc.ServicerContext) -> JobRecord:
        return find_job(self.store, job_id, context)


def _page_start(token: str, context: grpc.ServicerContext) -> int:
    """A page token is the position of the page's first job in the newest-first list."""
    if not token:
        return 0
    if not (token.isascii() and token.isdigit() and len(token) <= _MAX_TOKEN_DIGITS):
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"page_token {_quoted(token)} is not one we gave: pass next_page_token back as it came",
        )
    return int(token)


def _page_size(limit: int, context: grpc.ServicerContext) -> int:
    if limit < 0:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"limit {limit} is invalid: expected 1 to {_MAX_PAGE}, or 0 for {_DEFAULT_PAGE}",
        )
    return min(limit or _DEFAULT_PAGE, _MAX_PAGE)


def _quoted(value: str) -> str:
    """A value the caller sent, as a message quotes it: whole unless long (a status message
    travels in one HTTP/2 header, which clients cap)."""
    if len(value) <= _MAX_QUOTED:
        return repr(value)
    return f"{value[:_MAX_QUOTED]!r}... ({len(value)} characters)"


def _check_metadata(metadata: Mapping[str, str], context: grpc.ServicerContext) -> None:
    """Metadata travels with every status and list answer: it stays small."""
    size = sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items())
    if len(metadata) > _MAX_METADATA_ENTRIES or size > _MAX_METADATA_BYTES:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"metadata of {len(metadata)} entries and {size} bytes is too large: at most "
            f"{_MAX_METADATA_ENTRIES} entries and {_MAX_METADATA_BYTES} bytes of keys and values",
        )
