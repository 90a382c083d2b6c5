"""Prometheus metrics of a worker; served only when a metrics port is set."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.groups_leased = Gauge(
            "prefixgrove_worker_groups_leased", "Groups held now", registry=r
        )
        self.groups_done = Counter("prefixgrove_worker_groups_done", "Groups finished", registry=r)
        self.groups_taken_over = Counter(
            "prefixgrove_worker_groups_taken_over", "Groups taken from a dead worker", registry=r
        )
        self.requests_done = Counter(
            "prefixgrove_worker_requests_done", "Requests answered", registry=r
        )
        self.requests_failed = Counter(
            "prefixgrove_worker_requests_failed", "Requests refused by the engine", registry=r
        )
        self.output_tokens = Counter(
            "prefixgrove_worker_output_tokens", "Tokens generated", registry=r
        )
        self.tokens_per_second = Gauge(
            "prefixgrove_worker_output_tokens_per_second",
            "Generated tokens/s, last interval",
            registry=r,
        )
        self.prefix_tokens_reused = Counter(
            "prefixgrove_worker_prefix_tokens_reused",
            "Prompt tokens taken from a shared prefix instead of computed",
            registry=r,
        )

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
