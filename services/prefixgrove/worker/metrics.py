"""Prometheus metrics of a worker, each labelled with its served model name (the queue it leases
from), on a registry with the runtime collectors (metrics_registry.py); served only when a metrics
port is set."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from prefixgrove.metrics_registry import service_registry
from prefixgrove.worker import metrics_server

if TYPE_CHECKING:
    from prefixgrove.worker.engine_protocol import Engine

PHASES = ("idle", "lease", "step", "write")  # of the worker's loop
# Seconds from a group's queuing to its lease: up to a day (a long backlog)
QUEUE_WAIT_BUCKETS = (
    0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 86400,
)  # fmt: skip
# Seconds from a group's lease to its acknowledgement: a fraction of a second to an hour
GROUP_RUN_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600,
)  # fmt: skip
_Child = Counter | Gauge | Histogram
_RATE_WINDOW_S = 5.0  # tokens_per_second is the rate over at least this long


@dataclass(frozen=True)
class _Metric:
    attribute: str  # of WorkerMetrics
    kind: type[_Child]
    name: str
    doc: str
    buckets: tuple[float, ...] = ()  # a histogram's
    by_phase: bool = False  # labelled by phase too: the attribute maps each of PHASES to its child


_METRICS = (
    _Metric("groups_leased", Gauge, "prefixgrove_worker_groups_leased", "Groups held now"),
    _Metric("groups_done", Counter, "prefixgrove_worker_groups_done", "Groups finished"),
    _Metric("groups_taken_over", Counter, "prefixgrove_worker_groups_taken_over",
            "Groups taken from a dead worker"),
    _Metric("groups_sent", Counter, "prefixgrove_worker_groups_sent",
            "New groups sent to the worker holding their prefix (prefix-affine leasing)"),
    _Metric("requests_done", Counter, "prefixgrove_worker_requests_done", "Requests answered"),
    _Metric("requests_failed", Counter, "prefixgrove_worker_requests_failed",
            "Requests refused by the engine"),
    _Metric("prompt_tokens", Counter, "prefixgrove_worker_prompt_tokens_computed",
            "Prompt tokens whose KV the engine computed (a group's prefix once, recomputes after "
            "preemption again)"),
    _Metric("output_tokens", Counter, "prefixgrove_worker_output_tokens", "Tokens generated"),
    _Metric("tokens_per_second", Gauge, "prefixgrove_worker_output_tokens_per_second",
            "Generated tokens/s, last interval"),
    _Metric("prefix_tokens_reused", Counter, "prefixgrove_worker_prefix_tokens_reused",
            "Prompt tokens taken from a shared prefix instead of computed"),
    _Metric("queue_wait", Histogram, "prefixgrove_worker_group_queue_wait_seconds",
            "Seconds from a group's queuing to its first lease", QUEUE_WAIT_BUCKETS),
    _Metric("group_run", Histogram, "prefixgrove_worker_group_run_seconds",
            "Seconds from a group's lease to its acknowledgement, all of its results written",
            GROUP_RUN_BUCKETS),
    _Metric("kv_cache_usage", Gauge, "prefixgrove_worker_kv_cache_usage_ratio",
            "Share of the engine's KV-cache blocks that requests hold (0 to 1)"),
    _Metric("requests_running", Gauge, "prefixgrove_worker_requests_running",
            "Sequences in the engine's running batch (a request of n samples counts n)"),
    _Metric("requests_waiting", Gauge, "prefixgrove_worker_requests_waiting",
            "Sequences the engine holds and does not run yet (preempted ones included)"),
    _Metric("loop_seconds", Counter, "prefixgrove_worker_loop_seconds",
            "Seconds of the worker's loop by phase: idle (holding nothing, waiting for groups), "
            "lease (taking and loading groups), step (the engine), write (results to Redis, "
            "groups acknowledged)", by_phase=True),
    _Metric("requests_held", Gauge, "prefixgrove_worker_requests_held",
            "Leased requests not answered yet"),
    _Metric("results_unwritten", Gauge, "prefixgrove_worker_results_unwritten",
            "Results the worker holds and has not written to Redis yet"),
    _Metric("redis_out_of_memory", Gauge, "prefixgrove_worker_redis_out_of_memory",
            "1 while Redis refuses the worker's writes for lack of memory (results are kept, no "
            "group is taken), else 0"),
    _Metric("redis_refusals", Counter, "prefixgrove_worker_redis_refusals",
            "Writes Redis refused for lack of memory (each tried again after a pause)"),
)  # fmt: skip


class WorkerMetrics:
    groups_leased: Gauge
    groups_done: Counter
    groups_taken_over: Counter
    groups_sent: Counter
    requests_done: Counter
    requests_failed: Counter
    prompt_tokens: Counter
    output_tokens: Counter
    tokens_per_second: Gauge
    prefix_tokens_reused: Counter
    queue_wait: Histogram
    group_run: Histogram
    kv_cache_usage: Gauge
    requests_running: Gauge
    requests_waiting: Gauge
    loop_seconds: dict[str, Counter]
    requests_held: Gauge
    results_unwritten: Gauge
    redis_out_of_memory: Gauge
    redis_refusals: Counter

    def __init__(self, registry: CollectorRegistry | None = None, *, model: str = "") -> None:
        """`registry`: where the metrics go (a new one by default); the runtime collectors are
        registered on it either way. `model`: the served model name, every metric's label."""
        self.model = model
        self.registry = service_registry(registry)
        for metric in _METRICS:
            setattr(self, metric.attribute, self._register(metric))
        self._tokens_window = (time.monotonic(), 0)  # (since, output tokens since)
        self._reused_seen = self._prefill_seen = 0  # the engine's totals at the last look
        self.not_ready = ""  # why the worker cannot do its work now, as /ready answers it

    def _register(self, metric: _Metric) -> _Child | dict[str, _Child]:
        labels = ["model", "phase"] if metric.by_phase else ["model"]
        made: _Child
        if issubclass(metric.kind, Histogram):
            made = Histogram(metric.name, metric.doc, labels, registry=self.registry,
                             buckets=metric.buckets)  # fmt: skip
        else:
            made = metric.kind(metric.name, metric.doc, labels, registry=self.registry)
        if metric.by_phase:
            return {phase: made.labels(self.model, phase) for phase in PHASES}
        return made.labels(self.model)

    def answered(self, tokens: int) -> None:
        """A request answered with `tokens` generated."""
        self.requests_done.inc()
        self.output_tokens.inc(tokens)
        start, count = self._tokens_window
        count += tokens
        elapsed = time.monotonic() - start
        if elapsed >= _RATE_WINDOW_S:
            self.tokens_per_second.set(count / elapsed)
            start, count = time.monotonic(), 0
        self._tokens_window = (start, count)

    def observe_engine(self, engine: Engine) -> None:
        """The engine's prompt tokens (computed, reused) since the last call, and what it holds."""
        counters = engine.metrics
        reused, prefill = counters.prefix_tokens_reused, counters.prefill_tokens
        self.prefix_tokens_reused.inc(max(reused - self._reused_seen, 0))
        self.prompt_tokens.inc(max(prefill - self._prefill_seen, 0))
        self._reused_seen, self._prefill_seen = reused, prefill
        self.kv_cache_usage.set(engine.kv_cache_usage())
        self.requests_running.set(engine.num_running_requests())
        self.requests_waiting.set(engine.num_waiting_requests())

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Serves /metrics and /ready (metrics_server.py) on `host`."""
        metrics_server.serve(port, host, self.registry, lambda: self.not_ready)
