"""The Prometheus registry a service (planner, worker) serves: its own metrics beside
prometheus_client's process, platform and GC collectors, which a registry made apart from the
default one does not have (`process_resident_memory_bytes`, `process_cpu_seconds_total`,
`python_gc_*`, `python_info`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector


def service_registry(registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """`registry` (a new one by default) with the runtime collectors registered on it."""
    registry = registry if registry is not None else CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
