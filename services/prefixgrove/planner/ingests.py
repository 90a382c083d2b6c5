"""The uploads this replica takes part in: its cache of each job streaming in through it, the
served models' tokenizers, and the ends of uploads (sealed, cancelled, interrupted, abandoned by
their client, or orphaned by a planner that stopped)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping

import grpc

from prefixgrove.jobs.ingest import IngestedBatch, JobIngestor, JobPlan
from prefixgrove.jobs.line_parser import LineParser
from prefixgrove.jobs.redis_store.schema import JobRecord, JobState
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.jobs.redis_store.uploads import Uploads
from prefixgrove.jobs.tokenize import PromptTokenizer
from prefixgrove.settings import IngestSettings

log = logging.getLogger(__name__)


class JobIngest:
    """This replica's cache of a job streaming in: the prefix index of the lines it took (the
    whole job's when every stream went through here), and a lock so its streams take turns."""

    def __init__(self, job_id: str, ingestor: JobIngestor) -> None:
        self.job_id = job_id
        self.ingestor = ingestor
        self.lock = threading.Lock()

    def add(self, lines: Iterable[bytes], store: JobStore) -> IngestedBatch:
        """Takes in a chunk of lines and writes its requests to the store."""
        with self.lock:
            ing = self.ingestor
            batch = ing.add(lines)
            store.write_requests(self.job_id, batch, ing.total, ing.prompt_tokens)
        return batch


class Ingests:
    """The state of uploads lives in Redis (jobs/redis_store/uploads.py): what is kept here is a
    cache, which any replica's `end` may make stale and `forget_ended` drops."""

    def __init__(
        self,
        store: JobStore,
        uploads: Uploads,
        models: Mapping[str, str],
        settings: IngestSettings,
        parser: LineParser,
        instance: str,
    ) -> None:
        """`models`: served name -> tokenizer source; `instance`: this replica's name."""
        self.store = store
        self.uploads = uploads
        self.models = models
        self.settings = settings
        self.parser = parser
        self.instance = instance
        self._tokenizers: dict[str, PromptTokenizer] = {}  # by source: two names may share one
        self._ingests: dict[str, JobIngest] = {}
        self._lock = threading.Lock()

    def __contains__(self, job_id: str) -> bool:
        """Whether this replica holds a cache of the job."""
        with self._lock:
            return job_id in self._ingests

    def open(self, job: JobRecord, context: grpc.ServicerContext) -> JobIngest:
        """This replica's cache of the job, made on its first lines here; the job is ours now."""
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
                                       default_model=job.model)  # fmt: skip
                ingest = self._ingests[job.id] = JobIngest(job.id, ingestor)
        self.store.claim_ingest(job.id, self.instance)
        return ingest

    def cached_plan(self, job_id: str) -> dict[str, JobPlan] | None:
        """The job's plan per model from this replica's cache, when every request of the job
        came through here; else None."""
        with self._lock:
            ingest = self._ingests.get(job_id)
        if ingest is not None:
            with ingest.lock:
                if len(ingest.ingestor) == self.uploads.request_count(job_id):
                    return ingest.ingestor.plan()
        return None

    def end(self, job_id: str) -> None:
        self.forget(job_id)
        self.uploads.close(job_id)
        self.store.release_ingest(job_id)

    def fail(self, job_id: str, code: str, message: str) -> None:
        """Fails the job before its upload ends: a seal elsewhere finds the job ended, not an
        upload gone."""
        self.store.fail_ingest(job_id, code, message)
        self.end(job_id)

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
        for job_id in self.store.orphaned_ingests():
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
