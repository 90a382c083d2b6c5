"""A worker's Prometheus metrics: the runtime collectors on its own registry, and the counters,
histograms and gauges of a real worker running a job on a real redis-server and engine, scraped
over HTTP."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from queued_jobs import queue_shared_prefix_job
from services_testbed import MODEL, RedisServer, free_port

from prefixgrove.engine import EngineConfig, LLMEngine
from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.schema import JobState
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.settings import WorkerSettings
from prefixgrove.worker.metrics import WorkerMetrics
from prefixgrove.worker.runner import Worker

SERVED = "pool-a"  # the served name, not the weights' name: the label names the queue's model
GROUPS, PER_GROUP, MAX_TOKENS = 3, 6, 5
QUEUED_FOR_S = 1.0


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a scrape."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(scraped: dict, name: str, **labels: str) -> float:
    return scraped[(name, tuple(sorted(labels.items())))]


def test_a_registry_of_its_own_has_the_process_platform_and_gc_collectors() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, model="m")
    assert metrics.registry is registry
    scraped = samples(generate_latest(registry).decode())
    names = {name for name, _ in scraped}
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total"} <= names
    assert "python_gc_objects_collected_total" in names and "python_info" in names
    assert value(scraped, "process_resident_memory_bytes") > 0
    # every worker metric carries the model, present at 0 before anything happened
    assert value(scraped, "prefixgrove_worker_output_tokens_total", model="m") == 0
    assert value(scraped, "prefixgrove_worker_group_queue_wait_seconds_count", model="m") == 0
    assert value(scraped, "prefixgrove_worker_loop_seconds_total", model="m", phase="idle") == 0
    assert WorkerMetrics().registry is not WorkerMetrics().registry  # two workers, two registries


def iterate_until_done(worker: Worker, store: JobStore, job_id: str) -> list[list[float]]:
    """Runs the worker's loop until the job completes and the worker holds nothing (500 times at
    most); returns the gauges (KV use, running, waiting) after each iteration."""
    gauges = ("kv_cache_usage_ratio", "requests_running", "requests_waiting")
    seen: list[list[float]] = []
    for _ in range(500):
        worker._iteration(taking=True)
        registry = worker.metrics.registry
        seen.append([registry.get_sample_value(f"prefixgrove_worker_{g}", {"model": SERVED})
                     for g in gauges])  # fmt: skip
        if store.job_state(job_id) == JobState.COMPLETED and not worker.flights:
            break
    return seen


def test_a_worker_running_a_job_moves_its_counters_histograms_and_gauges(
    redis_server: RedisServer,
) -> None:
    store = JobStore(connect(redis_server.url))
    job_id = queue_shared_prefix_job(
        store, SERVED, groups=GROUPS, per_group=PER_GROUP, max_tokens=MAX_TOKENS
    )
    time.sleep(QUEUED_FOR_S)  # every group waits at least this long in the queue
    config = EngineConfig.create(MODEL, device="cpu", dtype="float32", max_model_len=1024,
                                 max_num_seqs=4)  # fmt: skip
    settings = WorkerSettings(redis_url=redis_server.url, model=MODEL, served_model_name=SERVED)
    worker = Worker(settings, LLMEngine(config))
    worker.store.ensure_queue(SERVED)
    seen = iterate_until_done(worker, store, job_id)
    assert store.job_state(job_id) == JobState.COMPLETED

    port = free_port()
    worker.metrics.serve(port)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    scraped = samples(text)
    worker_samples = [(n, dict(labels)) for n, labels in scraped if n.startswith("prefixgrove_")]
    assert worker_samples and all(labels["model"] == SERVED for _, labels in worker_samples)

    requests = GROUPS * PER_GROUP
    assert value(scraped, "prefixgrove_worker_requests_done_total", model=SERVED) == requests
    assert value(scraped, "prefixgrove_worker_groups_done_total", model=SERVED) == GROUPS
    assert value(scraped, "prefixgrove_worker_output_tokens_total", model=SERVED) == (
        requests * MAX_TOKENS
    )
    # Each group's 32-token prefix is computed once and taken by its requests; every request
    # computes its own 8 tokens at least (and its decode steps are not prompt tokens).
    reused = value(scraped, "prefixgrove_worker_prefix_tokens_reused_total", model=SERVED)
    computed = value(scraped, "prefixgrove_worker_prompt_tokens_computed_total", model=SERVED)
    assert reused >= GROUPS * (PER_GROUP - 1) * 32
    assert requests * 8 <= computed <= requests * 40
    assert computed + reused >= requests * 40

    wait = "prefixgrove_worker_group_queue_wait_seconds"
    assert value(scraped, f"{wait}_count", model=SERVED) == GROUPS
    assert value(scraped, f"{wait}_sum", model=SERVED) >= GROUPS * QUEUED_FOR_S
    assert value(scraped, f"{wait}_bucket", model=SERVED, le="0.5") == 0
    assert value(scraped, f"{wait}_bucket", model=SERVED, le="+Inf") == GROUPS
    run = "prefixgrove_worker_group_run_seconds"
    assert value(scraped, f"{run}_count", model=SERVED) == GROUPS
    assert value(scraped, f"{run}_sum", model=SERVED) > 0

    # While it ran, the engine held KV, ran at most max_num_seqs and queued the rest of a group
    # of 6; once done it holds nothing.
    assert all(0.0 <= kv <= 1.0 for kv, _, _ in seen) and max(kv for kv, _, _ in seen) > 0
    assert max(running for _, running, _ in seen) == 4
    assert max(waiting for _, _, waiting in seen) >= PER_GROUP - 4
    assert value(scraped, "prefixgrove_worker_kv_cache_usage_ratio", model=SERVED) == 0
    assert value(scraped, "prefixgrove_worker_requests_running", model=SERVED) == 0
    assert value(scraped, "prefixgrove_worker_requests_waiting", model=SERVED) == 0
    assert value(scraped, "prefixgrove_worker_groups_leased", model=SERVED) == 0
    assert "process_resident_memory_bytes" in text and "python_gc_objects_collected_total" in text
