"""Prometheus metrics of the planner, on a registry with the runtime collectors
(metrics_registry.py); served only when a metrics port is set.

Counters of request lines carry the `model` they go to: an accepted line its served model, a
rejected one its job's (a line's own model may be any text a client sent). A job's duration
(created to finished) is observed once, by the replica that sealed it, when the metrics thread
next finds it ended; a replica that stops first leaves its jobs unobserved.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from prefixgrove.jobs.ingest import IngestedBatch
from prefixgrove.jobs.redis_store.schema import JobRecord, JobState
from prefixgrove.jobs.redis_store.store import QueueDepth
from prefixgrove.jobs.requests import BatchRequest
from prefixgrove.metrics_registry import service_registry
from prefixgrove.planner.eta import eta_seconds

_REFRESH_S = 5.0
# Seconds from a job's creation to its end: a second to two days
JOB_DURATION_BUCKETS = (
    1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 43200, 86400, 172800,
)  # fmt: skip
_ENDED = tuple(state.value for state in JobState if state.terminal)
_MAX_FOLLOWED = 100_000  # jobs sealed here and not seen ended; beyond it the oldest go unobserved


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        """`registry`: where the metrics go (a new one by default); the runtime collectors are
        registered on it either way."""
        self.registry = service_registry(registry)
        gauge = partial(Gauge, registry=self.registry)
        counter = partial(Counter, labelnames=["model"], registry=self.registry)
        self.jobs_created = counter("prefixgrove_planner_jobs_created", "Jobs created")
        self.requests_accepted = counter(
            "prefixgrove_planner_requests_accepted", "Request lines validated and tokenized"
        )
        self.requests_rejected = counter(
            "prefixgrove_planner_requests_rejected",
            "Request lines refused at validation (counted under their job's model)",
        )
        self.prompt_tokens = counter(
            "prefixgrove_planner_prompt_tokens_tokenized",
            "Prompt tokens of the accepted request lines",
        )
        self.job_duration = Histogram(
            "prefixgrove_planner_job_duration_seconds",
            "Seconds from a job's creation to its end (completed, failed or cancelled)",
            ["model", "state"],
            registry=self.registry,
            buckets=JOB_DURATION_BUCKETS,
        )
        self.queue_waiting = gauge(
            "prefixgrove_queue_groups_waiting", "Groups queued and not leased"
        )
        self.queue_leased = gauge("prefixgrove_queue_groups_leased", "Groups a worker holds")
        self.queue_depth = gauge(
            "prefixgrove_queue_depth", "Groups not yet acknowledged (waiting + leased)"
        )
        self.job_eta = Gauge(
            "prefixgrove_planner_job_eta_seconds",
            "Seconds until a running job sealed here ends, as its plan and measured rate say "
            "(docs/plan.md); -1 while unknown; gone once the job ends",
            ["job"],
            registry=self.registry,
        )
        self._read_job: Callable[[str], JobRecord | None] | None = None
        self._followed: dict[str, None] = {}  # job ids, oldest first
        self._serving = False
        self._lock = threading.Lock()

    def declare_models(self, models: Iterable[str]) -> None:
        """Makes the series of each served model exist (at 0) before anything happens to it."""
        for model in models:
            for labelled in (self.jobs_created, self.requests_accepted, self.requests_rejected,
                             self.prompt_tokens):  # fmt: skip
                labelled.labels(model)
            for state in _ENDED:
                self.job_duration.labels(model, state)

    def count_lines(
        self, batch: IngestedBatch, model_of: Callable[[BatchRequest], str], job_model: str
    ) -> None:
        """Counts one batch of a job's lines: each accepted one, and its prompt tokens, under
        `model_of(request)`; the rejected ones under `job_model`."""
        accepted: dict[str, list[int]] = {}
        for request, token_ids in batch.requests:
            counts = accepted.setdefault(model_of(request), [0, 0])
            counts[0] += 1
            counts[1] += len(token_ids)
        for model, (requests, tokens) in accepted.items():
            self.requests_accepted.labels(model).inc(requests)
            self.prompt_tokens.labels(model).inc(tokens)
        if batch.errors:
            self.requests_rejected.labels(job_model).inc(len(batch.errors))

    def follow_jobs(self, read_job: Callable[[str], JobRecord | None]) -> None:
        """How the jobs sealed here are read back (the store's get_job) to observe their end."""
        self._read_job = read_job

    def job_sealed(self, job_id: str) -> None:
        """This replica seals the job: its duration is observed here once it has ended (only
        while the metrics are served: nothing else would read the jobs back)."""
        if not self._serving:
            return
        with self._lock:
            self._followed[job_id] = None
            if len(self._followed) > _MAX_FOLLOWED:
                del self._followed[next(iter(self._followed))]

    def observe_ended_jobs(self) -> int:
        """Observes the duration of each followed job that has ended, and stops following it (and
        those gone from Redis); sets the ETA of those still running. Returns how many ended."""
        if self._read_job is None:
            return 0
        with self._lock:
            followed = list(self._followed)
        observed = 0
        for job_id in followed:
            job = self._read_job(job_id)
            if job is not None and not job.state.terminal:
                self.job_eta.labels(job_id).set(eta_seconds(job, time.time()))
                continue
            if job is not None:
                seconds = max(job.finished_at - job.created_at, 0.0)
                self.job_duration.labels(job.model, job.state.value).observe(seconds)
                observed += 1
            with self._lock:
                self._followed.pop(job_id, None)
            with suppress(KeyError):  # never set: the job ended before a refresh saw it run
                self.job_eta.remove(job_id)
        return observed

    def serve(
        self,
        port: int,
        queue: Callable[[], QueueDepth],
        stop: threading.Event,
        host: str = "127.0.0.1",
    ) -> list[threading.Thread]:
        """Serves /metrics on `host` (NOTE: prometheus_client's own default is every address)
        and, every few seconds until `stop` is set, refreshes the queue gauges and observes the
        jobs that ended; returns the threads doing it."""
        httpd, http_thread = start_http_server(port, addr=host, registry=self.registry)
        self._serving = True

        def refresh() -> None:
            while True:
                self._refresh(queue)
                if stop.wait(_REFRESH_S):
                    break
            httpd.shutdown()
            httpd.server_close()

        thread = threading.Thread(target=refresh, name="metrics-queue", daemon=True)
        thread.start()
        return [thread, http_thread]

    def _refresh(self, queue: Callable[[], QueueDepth]) -> None:
        try:
            self.observe_ended_jobs()
            depth = queue()
        except Exception:  # Redis away: keep the last values, try again
            return
        self.queue_waiting.set(depth.waiting)
        self.queue_leased.set(depth.leased)
        self.queue_depth.set(depth.depth)
