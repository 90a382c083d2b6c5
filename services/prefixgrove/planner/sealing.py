"""SealJob: the end of a job's input. One call on one replica seals a job (a claim in Redis says
which); the job is grouped and its groups queued, or it fails when its input is not a batch or
lost lines. A second call waits for that seal and answers the job it left."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import redis

from prefixgrove.jobs.ingest import JobPlan, UploadCounts, job_error
from prefixgrove.jobs.job_tally import JobTally
from prefixgrove.jobs.redis_store.dry_runs import DryRuns
from prefixgrove.jobs.redis_store.schema import JobRecord, JobState
from prefixgrove.jobs.redis_store.uploads import rebuild_plan
from prefixgrove.planner.dry_runs import DryRunPlanner
from prefixgrove.planner.ingests import Ingests
from prefixgrove.planner.input_digest import Fingerprint
from prefixgrove.planner.job_messages import POLL_S, find_job, job_to_pb
from prefixgrove.planner.metrics import PlannerMetrics
from prefixgrove_proto import planner_pb2 as pb

log = logging.getLogger(__name__)
_STORE_WAIT_S = 10.0  # how long a seal waits for lines other streams took and still write
_SEAL_WAIT_S = 30.0  # how long a second SealJob waits for the seal running elsewhere


class Sealer:
    """Seals jobs on this replica: notes which it seals right now, so a second call here waits.
    It seals in the job store and the uploads of the replica's ingests."""

    def __init__(self, ingests: Ingests, metrics: PlannerMetrics) -> None:
        self.ingests = ingests
        self.store, self.uploads = ingests.store, ingests.uploads
        self.metrics = metrics
        self.dry_runs = DryRunPlanner(DryRuns(ingests.store), ingests.models, ingests.aliases)
        self._sealing: set[str] = set()  # jobs this replica seals right now
        self._lock = threading.Lock()

    @property
    def instance(self) -> str:
        return self.ingests.instance

    def seal(self, job_id: str, context: grpc.ServicerContext) -> pb.Job:
        job = find_job(self.store, job_id, context)
        if job.state != JobState.VALIDATING:
            return job_to_pb(job, self.store)  # sealing twice is harmless
        with self._lock:
            busy = job.id in self._sealing
            self._sealing.add(job.id)
        if busy:
            return job_to_pb(self._sealed_elsewhere(job.id, self.instance, context), self.store)
        try:
            return self._claim_and_seal(job, context)
        except redis.OutOfMemoryError:
            self.ingests.fail_out_of_memory(job, context)
        finally:
            with self._lock:
                self._sealing.discard(job.id)

    def _claim_and_seal(self, job: JobRecord, context: grpc.ServicerContext) -> pb.Job:
        """Seals the job here, or waits for the seal another replica claimed."""
        claim = self.uploads.claim_seal(job.id, self.instance)
        if claim.counts is None:
            return job_to_pb(self._sealed_elsewhere(job.id, claim.holder, context), self.store)
        self.uploads.claim_ingest(job.id, self.instance)  # if we stop now, others fail the job
        self.metrics.job_sealed(job.id)
        self._seal(job, claim.counts, context)
        return job_to_pb(find_job(self.store, job.id, context), self.store)

    def _seal(self, job: JobRecord, counts: UploadCounts, context: grpc.ServicerContext) -> None:
        """Groups the job and queues its groups; fails it (and the call) when its input is not
        a batch, lost lines or is not the input it was created for."""
        self._check_whole(job, counts.lines, context)
        error = job_error(counts)
        if error is not None:
            self.ingests.fail(job.id, *error)
            code = (
                grpc.StatusCode.FAILED_PRECONDITION
                if error[0] == "empty_file"
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            context.abort(code, f"job {job.id} failed: {error[1]}")
        self._check_same_input(job, counts.lines, context)
        if not self._all_lines_stored(job.id, counts.lines):
            message = (
                "lines of the input were taken but never stored (a planner stopped while it "
                "took them); submit the job again"
            )
            self.ingests.fail(job.id, "ingest_interrupted", message)
            context.abort(grpc.StatusCode.ABORTED, f"job {job.id} failed: {message}")
        start = time.perf_counter()
        plans, tally, path = self._plan(job, counts.lines)
        self.uploads.write_totals(job.id, counts)
        job = find_job(self.store, job.id, context)  # its totals, for its plan
        if job.state != JobState.VALIDATING:
            self.store.cancel(job.id)  # cancelled while streaming in: nothing to queue
        elif job.dry_run:  # planned, and nothing runs
            self.dry_runs.end(job, counts.lines, plans, tally)
        else:
            if tally is not None:  # kept before the groups go out: the ETA starts from it
                self.dry_runs.keep(job, tally, plans)
            self.store.queue_plans(job.id, plans)
        self.ingests.end(job.id)
        units = {model: len(plan.units) for model, plan in plans.items()}
        saved = sum(plan.prefix_tokens_saved for plan in plans.values())
        log.info("sealed job %s: units %s, %d tokens saved, grouped (%s) in %.2fs", job.id,
                 units, saved, path, time.perf_counter() - start)  # fmt: skip

    def _check_whole(self, job: JobRecord, lines: int, context: grpc.ServicerContext) -> None:
        """A job created with its input's fingerprint is sealed only once it holds every line of
        that input: until then the call is refused and the job takes the rest."""
        if job.input_digest and lines < job.input_lines:
            self.uploads.release_seal(job.id, self.instance)
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"job {job.id} holds {lines} of the {job.input_lines} request lines of its input: "
                f"send the rest (from line {lines}) and seal it again",
            )

    def _check_same_input(self, job: JobRecord, lines: int, context: grpc.ServicerContext) -> None:
        """Fails a job whose lines are not the input it was created for (ABORTED: submitted again,
        it starts over as a clean job)."""
        if not job.input_digest:
            return
        held = Fingerprint()
        for digests in self.uploads.line_digests(job.id, lines):
            held.add_digests(digests)
        if (held.lines, held.digest) == (job.input_lines, job.input_digest):
            return
        message = (
            f"the job holds {held.lines} request lines of digest {held.digest[:16]}, not the "
            f"{job.input_lines} lines of digest {job.input_digest[:16]} it was created for; "
            "submit the job again"
        )
        self.ingests.fail(job.id, "input_mismatch", message)
        context.abort(grpc.StatusCode.ABORTED, f"job {job.id} failed: {message}")

    def _plan(self, job: JobRecord, lines: int) -> tuple[dict[str, JobPlan], JobTally | None, str]:  # fmt: skip
        """The job's plan per model, the tally of its model's requests when this replica took
        them all, and how the plan was built: from this replica's indexes when every request
        came through here, else from the request records in Redis."""
        cached = self.ingests.cached_plan(job.id)
        if cached is not None:
            return *cached, "cached index"
        settings = self.ingests.settings
        plans = rebuild_plan(self.uploads, job.id, lines, settings, job.model, self.ingests.aliases)
        return plans, None, "rebuilt index"

    def _all_lines_stored(self, job_id: str, lines: int) -> bool:
        """Waits a little for streams still writing lines they took before the seal."""
        deadline = time.monotonic() + _STORE_WAIT_S
        while self.uploads.stored(job_id) < lines:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S / 5)
        return True

    def _sealed_elsewhere(
        self, job_id: str, holder: str, context: grpc.ServicerContext
    ) -> JobRecord:
        """The job once the seal another call runs (here or on `holder`) has ended it."""
        deadline = time.monotonic() + _SEAL_WAIT_S
        while context.is_active() and time.monotonic() < deadline:
            job = find_job(self.store, job_id, context)
            if job.state != JobState.VALIDATING:
                return job
            if not holder:  # no upload open and no seal running: nothing will seal it
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"job {job_id} has no upload open to seal (its input is gone)",
                )
            time.sleep(POLL_S)
        context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"job {job_id} is being sealed by planner {holder}; ask again",
        )
        raise AssertionError("abort raises")  # for the type checker
