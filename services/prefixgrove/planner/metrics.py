"""Prometheus metrics of the planner; served only when a metrics port is set."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from prefixgrove.jobs.store import QueueDepth

_REFRESH_S = 5.0


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        counter = partial(Counter, registry=self.registry)
        gauge = partial(Gauge, registry=self.registry)
        self.jobs_created = counter("prefixgrove_planner_jobs_created", "Jobs created")
        self.requests_accepted = counter(
            "prefixgrove_planner_requests_accepted", "Request lines validated and tokenized"
        )
        self.requests_rejected = counter(
            "prefixgrove_planner_requests_rejected", "Request lines refused at validation"
        )
        self.queue_waiting = gauge(
            "prefixgrove_queue_groups_waiting", "Groups queued and not leased"
        )
        self.queue_leased = gauge("prefixgrove_queue_groups_leased", "Groups a worker holds")
        self.queue_depth = gauge(
            "prefixgrove_queue_depth", "Groups not yet acknowledged (waiting + leased)"
        )

    def serve(
        self, port: int, queue: Callable[[], QueueDepth], stop: threading.Event
    ) -> list[threading.Thread]:
        """Serves /metrics and refreshes the queue gauges every few seconds until `stop` is set;
        returns the threads doing it."""
        httpd, http_thread = start_http_server(port, registry=self.registry)

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
            depth = queue()
        except Exception:  # Redis away: keep the last values, try again
            return
        self.queue_waiting.set(depth.waiting)
        self.queue_leased.set(depth.leased)
        self.queue_depth.set(depth.depth)
