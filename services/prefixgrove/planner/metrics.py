"""Prometheus metrics of the planner; served only when a metrics port is set."""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from prefixgrove.jobs.store import QueueDepth


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.jobs_created = Counter("prefixgrove_planner_jobs_created", "Jobs created", registry=r)
        self.requests_accepted = Counter(
            "prefixgrove_planner_requests_accepted",
            "Request lines validated and tokenized",
            registry=r,
        )
        self.requests_rejected = Counter(
            "prefixgrove_planner_requests_rejected",
            "Request lines refused at validation",
            registry=r,
        )
        self.queue_waiting = Gauge(
            "prefixgrove_queue_groups_waiting", "Groups queued and not leased", registry=r
        )
        self.queue_leased = Gauge(
            "prefixgrove_queue_groups_leased", "Groups a worker holds", registry=r
        )
        self.queue_depth = Gauge(
            "prefixgrove_queue_depth", "Groups not yet acknowledged (waiting + leased)", registry=r
        )

    def serve(self, port: int, queue: Callable[[], QueueDepth]) -> None:
        """Serves /metrics and refreshes the queue gauges every few seconds."""
        start_http_server(port, registry=self.registry)

        def refresh() -> None:
            while True:
                try:
                    depth = queue()
                    self.queue_waiting.set(depth.waiting)
                    self.queue_leased.set(depth.leased)
                    self.queue_depth.set(depth.depth)
                except Exception:  # Redis away: keep the last values, try again
                    pass
                threading.Event().wait(5.0)

        threading.Thread(target=refresh, name="metrics-queue", daemon=True).start()
