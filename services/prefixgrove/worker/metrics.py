"""Prometheus metrics of a worker, each labelled with its served model name (the queue it leases
from), on a registry with the runtime collectors (metrics_registry.py); served only when a metrics
port is set."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from prefixgrove.metrics_registry import service_registry

PHASES = ("idle", "lease", "step", "write")  # of the worker's loop
# Seconds from a group's queuing to its lease: up to a day (a long backlog)
QUEUE_WAIT_BUCKETS = (
    0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 86400,
)  # fmt: skip
# Seconds from a group's lease to its acknowledgement: a fraction of a second to an hour
GROUP_RUN_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600,
)  # fmt: skip


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, *, model: str = "") -> None:
        """`registry`: where the metrics go (a new one by default); the runtime collectors are
        registered on it either way. `model`: the served model name, every metric's label."""
        self.model = model
        self.registry = service_registry(registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model"], registry=self.registry).labels(model)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model"], registry=self.registry).labels(model)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            made = Histogram(name, doc, ["model"], registry=self.registry, buckets=buckets)
            return made.labels(model)

        self.groups_leased = gauge("prefixgrove_worker_groups_leased", "Groups held now")
        self.groups_done = counter("prefixgrove_worker_groups_done", "Groups finished")
        self.groups_taken_over = counter(
            "prefixgrove_worker_groups_taken_over", "Groups taken from a dead worker"
        )
        self.requests_done = counter("prefixgrove_worker_requests_done", "Requests answered")
        self.requests_failed = counter(
            "prefixgrove_worker_requests_failed", "Requests refused by the engine"
        )
        self.prompt_tokens = counter(
            "prefixgrove_worker_prompt_tokens_computed",
            "Prompt tokens whose KV the engine computed (a group's prefix once, recomputes after "
            "preemption again)",
        )
        self.output_tokens = counter("prefixgrove_worker_output_tokens", "Tokens generated")
        self.tokens_per_second = gauge(
            "prefixgrove_worker_output_tokens_per_second", "Generated tokens/s, last interval"
        )
        self.prefix_tokens_reused = counter(
            "prefixgrove_worker_prefix_tokens_reused",
            "Prompt tokens taken from a shared prefix instead of computed",
        )
        self.queue_wait = histogram(
            "prefixgrove_worker_group_queue_wait_seconds",
            "Seconds from a group's queuing to its first lease",
            QUEUE_WAIT_BUCKETS,
        )
        self.group_run = histogram(
            "prefixgrove_worker_group_run_seconds",
            "Seconds from a group's lease to its acknowledgement, all of its results written",
            GROUP_RUN_BUCKETS,
        )
        self.kv_cache_usage = gauge(
            "prefixgrove_worker_kv_cache_usage_ratio",
            "Share of the engine's KV-cache blocks that requests hold (0 to 1)",
        )
        self.requests_running = gauge(
            "prefixgrove_worker_requests_running",
            "Sequences in the engine's running batch (a request of n samples counts n)",
        )
        self.requests_waiting = gauge(
            "prefixgrove_worker_requests_waiting",
            "Sequences the engine holds and does not run yet (preempted ones included)",
        )
        loop = Counter(
            "prefixgrove_worker_loop_seconds",
            "Seconds of the worker's loop by phase: idle (holding nothing, waiting for groups), "
            "lease (taking and loading groups), step (the engine), write (results to Redis, "
            "groups acknowledged)",
            ["model", "phase"],
            registry=self.registry,
        )
        self.loop_seconds = {phase: loop.labels(model, phase) for phase in PHASES}
        self.requests_held = gauge(
            "prefixgrove_worker_requests_held", "Leased requests not answered yet"
        )

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
