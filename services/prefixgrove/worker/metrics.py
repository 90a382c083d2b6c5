"""Prometheus metrics of a worker; served only when a metrics port is set."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        counter = partial(Counter, registry=self.registry)
        gauge = partial(Gauge, registry=self.registry)
        self.groups_leased = gauge("prefixgrove_worker_groups_leased", "Groups held now")
        self.groups_done = counter("prefixgrove_worker_groups_done", "Groups finished")
        self.groups_taken_over = counter(
            "prefixgrove_worker_groups_taken_over", "Groups taken from a dead worker"
        )
        self.requests_done = counter("prefixgrove_worker_requests_done", "Requests answered")
        self.requests_failed = counter(
            "prefixgrove_worker_requests_failed", "Requests refused by the engine"
        )
        self.output_tokens = counter("prefixgrove_worker_output_tokens", "Tokens generated")
        self.tokens_per_second = gauge(
            "prefixgrove_worker_output_tokens_per_second", "Generated tokens/s, last interval"
        )
        self.prefix_tokens_reused = counter(
            "prefixgrove_worker_prefix_tokens_reused",
            "Prompt tokens taken from a shared prefix instead of computed",
        )

        self.loop_seconds = Counter(
            "prefixgrove_worker_loop_seconds",
            "Seconds of the worker's loop by phase: idle (holding nothing, waiting for groups), "
            "lease (taking and loading groups), step (the engine), write (results to Redis, "
            "groups acknowledged)",
            ["phase"],
            registry=self.registry,
        )
        self.requests_held = gauge(
            "prefixgrove_worker_requests_held", "Leased requests not answered yet"
        )

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
