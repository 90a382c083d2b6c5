"""The uploads this replica takes part in: its cache of each job streaming in through it, the
served models' tokenizers, and the ends of uploads (sealed, cancelled, interrupted, abandoned by
their client, or orphaned by a planner that stopped)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import grpc
import redis

from prefixgrove.jobs.ingest import IngestedBatch, JobIngestor, JobPlan
from prefixgrove.jobs.job_tally import JobTally
from prefixgrove.jobs.line_parser import LineParser
from prefixgrove.jobs.redis_store.idempotency import InputConflict, check_same_input
from prefixgrove.jobs.redis_store.schema import JobRecord, JobState
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.jobs.redis_store.uploads import LineDiffers, LineGap, RedisLedger, Uploads
from prefixgrove.jobs.tokenize import PromptTokenizer
from prefixgrove.planner.input_digest import is_request_line, line_digest
from prefixgrove.settings import IngestSettings

log = logging.getLogger(__name__)


class JobIngest:
    """This replica's cache of a job streaming in: the prefix index of the lines it took (the
    whole job's when every stream went through here), and a lock so its streams take turns."""

    def __init__(self, job_id: str, ingestor: JobIngestor, ledger: RedisLedger) -> None:
        self.job_id = job_id
        self.ingestor = ingestor
        self.ledger = ledger
        self.lock = threading.Lock()
        self.tally = JobTally()  # the job's own model's requests taken here, for its plan

    def add(self, lines: Sequence[bytes], first_line: int | None, store: JobStore) -> IngestedBatch:
        """Takes in a chunk of request lines (none blank) placed from `first_line` (None: after
        the lines the job holds) and writes the requests of those the job did not hold."""
        digests = [line_digest(line) for line in lines]
        with self.lock:
            skipped = self.ledger.place(first_line, digests)
            ing = self.ingestor
            batch = ing.add(lines[skipped:])
            store.write_requests(self.job_id, batch, ing.total, ing.prompt_tokens)
            for request, tokens in batch.requests:
                if ing.model_of(request) == ing.default_model:
                    self.tally.add_request(request.index, len(tokens), request.params)
        return batch


class UploadStream:
    """One AddRequests call into a job: where its next line goes, when the call places its lines
    (`first_line` on its first chunk), and the refusals it ends with."""

    def __init__(self, ingests: Ingests, ingest: JobIngest, job: JobRecord,
                 first_line: int | None, context: grpc.ServicerContext) -> None:  # fmt: skip
        self.ingests, self.ingest, self.job, self.context = ingests, ingest, job, context
        self.position = first_line

    @property
    def ingestor(self) -> JobIngestor:
        return self.ingest.ingestor

    def add(self, lines: Sequence[bytes], store: JobStore) -> IngestedBatch:
        kept = [line for line in lines if is_request_line(line)]
        try:
            batch = self.ingest.add(kept, self.position, store)
        except LineDiffers as exc:
            key = self.job.idempotency_key
            under = f" under idempotency key {key!r}" if key else ""
            self.context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"{exc}, sent by an earlier upload{under}: this is another input; nothing of "
                "this chunk was added (submit it under another key)",
            )
        except LineGap as exc:
            self.context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except redis.OutOfMemoryError:
            self.ingests.fail_out_of_memory(self.job, self.context)
        if self.position is not None:
            self.position += len(kept)
        return batch


@dataclass(eq=False)
class Ingests:
    """The state of uploads lives in Redis (jobs/redis_store/uploads.py): what is kept here is a
    cache, which any replica's `end` may make stale and `forget_ended` drops."""

    store: JobStore
    uploads: Uploads
    models: Mapping[str, str]  # served name -> tokenizer source
    settings: IngestSettings
    parser: LineParser
    instance: str  # this replica's name
    aliases: Mapping[str, str] = field(default_factory=dict)  # alias -> served name
    # by source: two names may share one
    _tokenizers: dict[str, PromptTokenizer] = field(default_factory=dict, init=False)
    _ingests: dict[str, JobIngest] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __contains__(self, job_id: str) -> bool:
        """Whether this replica holds a cache of the job."""
        with self._lock:
            return job_id in self._ingests

    def create(
        self,
        model: str,
        key: str,
        metadata: dict[str, str],
        input_lines: int,
        input_digest: str,
        context: grpc.ServicerContext,
    ) -> tuple[JobRecord, bool]:
        """(job, created): a new job with its upload open, or the job `key` already names (of the
        same input: another is refused, ALREADY_EXISTS). The upload opens before the key names
        the job, so whoever finds the job by its key can stream into it at once."""
        try:
            job = self.store.new_job(model, key, metadata, input_lines, input_digest)
            existing = self._open_and_claim(job)
            if existing is None:
                return job, True
            check_same_input(existing, input_lines, input_digest)
            return existing, False
        except InputConflict as exc:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except redis.OutOfMemoryError:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          "Redis is out of memory (it refuses writes past its maxmemory): no job "
                          "was created; submit again once it has room")  # fmt: skip
        raise AssertionError("abort raises")  # for the type checker

    def _open_and_claim(self, job: JobRecord) -> JobRecord | None:
        """Opens the new job's upload and lists it once its key names it; returns the job the key
        names instead, if any (the new one is dropped then, as it is when Redis is full)."""
        try:
            self.uploads.claim_ingest(job.id, self.instance)  # should we stop, others fail it
            self.uploads.open(job.id)
            existing = self.store.claim_key(job)
            if existing is None:
                self.store.list_job(job)
                return None
        except redis.OutOfMemoryError:
            self._drop(job)
            raise
        self._drop(job)
        return existing

    def _drop(self, job: JobRecord) -> None:
        self.end(job.id)
        self.store.drop_job(job.id)
        if job.idempotency_key:  # names the job only if this call made it do so
            self.store.keys.release(job.idempotency_key, job.id)

    def open(
        self, job: JobRecord, context: grpc.ServicerContext, first_line: int | None = None
    ) -> UploadStream:
        """A stream into the job, through this replica's cache of it (made on its first lines
        here); the job is ours now. `first_line`: where the stream's lines go (None: after those
        the job holds)."""
        if job.state != JobState.VALIDATING or not self.uploads.is_open(job.id):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"job {job.id} no longer takes requests: it is {job.state.value}",
            )
        tokenizers = self.tokenizers(context)
        with self._lock:
            ingest = self._ingests.get(job.id)
            if ingest is None:
                ledger = self.uploads.ledger(job.id)
                ingestor = JobIngestor(tokenizers, self.settings, ledger, self.parser,
                                       default_model=job.model, aliases=self.aliases)  # fmt: skip
                ingest = self._ingests[job.id] = JobIngest(job.id, ingestor, ledger)
        try:
            self.uploads.claim_ingest(job.id, self.instance)
        except redis.OutOfMemoryError:
            self.fail_out_of_memory(job, context)
        return UploadStream(self, ingest, job, first_line, context)

    def cached_plan(self, job_id: str) -> tuple[dict[str, JobPlan], JobTally] | None:
        """The job's plan per model and the tally of its own model's requests from this
        replica's cache, when every request of the job came through here; else None."""
        with self._lock:
            ingest = self._ingests.get(job_id)
        if ingest is not None:
            with ingest.lock:
                if len(ingest.ingestor) == self.uploads.request_count(job_id):
                    return ingest.ingestor.plan(), ingest.tally
        return None

    def end(self, job_id: str) -> None:
        self.forget(job_id)
        self.uploads.close(job_id)
        self.uploads.release_ingest(job_id)

    def fail(self, job_id: str, code: str, message: str) -> None:
        """Fails the job before its upload ends: a seal elsewhere finds the job ended, not an
        upload gone."""
        self.store.fail_ingest(job_id, code, message)
        self.end(job_id)

    def fail_out_of_memory(self, job: JobRecord, context: grpc.ServicerContext) -> NoReturn:
        """Fails a job whose upload or seal Redis refused for lack of memory, and the call with
        RESOURCE_EXHAUSTED: its lines go first (room for the rest), its key is freed."""
        key = job.idempotency_key
        freed = f", and its idempotency key {key!r} is free" if key else ""
        message = (
            "Redis is out of memory (it refuses writes past its maxmemory): the upload stopped, "
            f"the job failed{freed}; submit again once Redis has room"
        )
        self.forget(job.id)
        self.uploads.close(job.id)
        self.store.fail_ingest_out_of_memory(job.id, message)
        self.uploads.release_ingest(job.id)
        log.warning("job %s failed: Redis is out of memory", job.id)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"job {job.id} failed: {message}")
        raise AssertionError("abort raises")  # for the type checker

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._ingests.pop(job_id, None)

    def forget_ended(self) -> None:
        """Drops the cache of each job whose upload another replica ended."""
        with self._lock:
            cached = list(self._ingests)
        for job_id in cached:
            if not self.uploads.is_open(job_id):
                self.forget(job_id)

    def fail_orphaned(self) -> list[str]:
        """Fails the jobs whose planner stopped while it took their input or sealed them: a
        stream it had open may have lost lines. Other planners' jobs (a rolling update, another
        replica) are left alone. Returns the jobs failed."""
        failed = []
        for job_id in self.uploads.orphaned_ingests():
            if self.store.job_state(job_id) == JobState.VALIDATING:
                message = (
                    "the planner stopped while the input was streaming in; submit the job again"
                )
                self.fail(job_id, "ingest_interrupted", message)
                log.warning("job %s failed: its planner stopped during the upload", job_id)
                failed.append(job_id)
            else:
                self.end(job_id)
        return failed

    def expire_idle(self, idle_s: float, now: float | None = None) -> list[str]:
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
            self.end(job_id)
            log.warning("job %s failed: its upload was abandoned", job_id)
            expired.append(job_id)
        return expired

    def interrupt(self, job: JobRecord) -> JobRecord:
        """The client's upload broke: a job never sealed fails, freeing its idempotency key for
        the new job the client makes; a job sealed meanwhile is left as it is."""
        if job.state == JobState.VALIDATING:
            message = "the upload broke before the seal; the client submitted the input again"
            self.fail(job.id, "ingest_interrupted", message)
            self.uploads.drop_unsealed_requests(job.id)
            log.warning("job %s failed: its client's upload broke", job.id)
        return self.store.get_job(job.id) or job

    def tokenizers(self, context: grpc.ServicerContext) -> dict[str, PromptTokenizer]:
        """Every served model's tokenizer by served name (a job's lines may name any of them),
        each source loaded once."""
        return {name: self._tokenizer(name, source, context) for name, source in self.models.items()}  # fmt: skip

    def _tokenizer(self, name: str, source: str, context: grpc.ServicerContext) -> PromptTokenizer:
        with self._lock:
            if source not in self._tokenizers:
                try:
                    self._tokenizers[source] = PromptTokenizer(source, self.settings.max_model_len)
                except (ValueError, OSError):
                    log.exception("the tokenizer of model %r (%s) did not load", name, source)
                    context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"model {name!r} cannot be served: its tokenizer did not load "
                        "(the planner's log says why)",
                    )
            return self._tokenizers[source]
