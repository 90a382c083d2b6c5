"""The planner's Prometheus metrics, scraped over HTTP from a real planner (gRPC on loopback, a real
redis-server): the runtime collectors, request lines and prompt tokens by model, and the duration of
the jobs it sealed, observed once each, when they end (cancelled here; completed by a real worker)."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from polling import wait_for
from prometheus_client.parser import text_string_to_metric_families
from services_testbed import MODEL, RedisServer, batch_line, free_port

from prefixgrove.engine import EngineConfig, LLMEngine
from prefixgrove.jobs.redis_store.schema import JobRecord, JobState
from prefixgrove.planner import metrics as planner_metrics
from prefixgrove.planner.client import PlannerClient
from prefixgrove.planner.metrics import PlannerMetrics
from prefixgrove.planner.server import PlannerServer, build_server
from prefixgrove.settings import IngestSettings, PlannerSettings, SecuritySettings, WorkerSettings
from prefixgrove.worker.runner import Worker
from prefixgrove_proto import planner_pb2 as pb

SECOND = "second"  # the same tokenizer served under a second name
UNKNOWN = "nobody-serves-this"
DURATION = "prefixgrove_planner_job_duration_seconds"


@dataclass
class Planner:
    server: PlannerServer
    client: PlannerClient
    metrics_port: int

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """{(sample name, sorted labels): value} of the planner's /metrics."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def value(self, name: str, **labels: str) -> float | None:
        return self.scrape().get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def planner(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[Planner]:
    # ended jobs are observed at the metrics' next refresh: sooner than the planner's default
    monkeypatch.setattr(planner_metrics, "_REFRESH_S", 0.2)
    metrics_port = free_port()
    settings = PlannerSettings(redis_url=redis_server.url, host="127.0.0.1", port=0,
                               model=f"{MODEL},{SECOND}={MODEL}", metrics_port=metrics_port)  # fmt: skip
    server = build_server(settings, IngestSettings(max_model_len=512), SecuritySettings())
    client = PlannerClient(f"127.0.0.1:{server.port}")
    yield Planner(server, client, metrics_port)
    client.close()
    server.stop(0)


def lines(n: int, **body: str) -> list[bytes]:
    """n request lines sharing a prefix; their custom ids name their body's model."""
    prefix = "Shared instructions for every request. " * 4
    ids = [f"{body.get('model', '')}-{i}" for i in range(n)]
    return [
        batch_line(id_, {"prompt": f"{prefix}item {i}", "max_tokens": 2, **body}).encode()
        for i, id_ in enumerate(ids)
    ]


def test_the_runtime_collectors_are_served_and_every_served_model_starts_at_zero(
    planner: Planner,
) -> None:
    scraped = planner.scrape()
    names = {name for name, _ in scraped}
    assert {"process_resident_memory_bytes", "python_gc_objects_collected_total"} <= names
    assert scraped[("process_resident_memory_bytes", ())] > 0
    for model in (MODEL, SECOND):
        assert planner.value("prefixgrove_planner_requests_accepted_total", model=model) == 0
        assert planner.value(f"{DURATION}_count", model=model, state="completed") == 0


def test_lines_and_prompt_tokens_count_under_their_model_rejected_ones_under_the_jobs(
    planner: Planner,
) -> None:
    job = planner.client.create_job(model=SECOND)
    reply = planner.client.add_lines(job.id, [
        *lines(4), *lines(3, model=MODEL), b"{broken", *lines(1, model=UNKNOWN),
    ])  # fmt: skip
    assert (reply.accepted, reply.rejected) == (7, 2)
    accepted = "prefixgrove_planner_requests_accepted_total"
    assert planner.value(accepted, model=SECOND) == 4 and planner.value(accepted, model=MODEL) == 3
    assert planner.value("prefixgrove_planner_requests_rejected_total", model=SECOND) == 2
    assert planner.value("prefixgrove_planner_requests_rejected_total", model=MODEL) == 0
    assert all(UNKNOWN not in dict(labels).values() for _, labels in planner.scrape())
    assert planner.value("prefixgrove_planner_jobs_created_total", model=SECOND) == 1
    tokens = "prefixgrove_planner_prompt_tokens_tokenized_total"
    counted = (planner.value(tokens, model=SECOND) or 0) + (planner.value(tokens, model=MODEL) or 0)
    assert counted == planner.client.get(job.id).prompt_tokens > 0
    # the same prompts under both names: 4 and 3 of them
    assert (planner.value(tokens, model=SECOND) or 0) > (planner.value(tokens, model=MODEL) or 0)


def test_a_sealed_job_that_ends_is_observed_once_with_its_model_and_state(
    planner: Planner,
) -> None:
    unsealed = planner.client.create_job()  # never sealed here: not followed
    job = planner.client.create_job(model=SECOND)
    planner.client.add_lines(job.id, lines(3))
    planner.client.seal(job.id)
    cancelled = planner.client.cancel(job.id)
    assert cancelled.state == pb.JOB_STATE_CANCELLED
    wait_for(
        "the cancelled job's duration",
        lambda: planner.value(f"{DURATION}_count", model=SECOND, state="cancelled") == 1,
    )
    ended = planner.client.get(job.id)
    assert planner.value(f"{DURATION}_sum", model=SECOND, state="cancelled") == pytest.approx(
        ended.finished_at - ended.created_at
    )
    assert planner.server.service.metrics.observe_ended_jobs() == 0  # not observed again
    planner.client.cancel(unsealed.id)
    assert planner.server.service.metrics.observe_ended_jobs() == 0
    assert planner.value(f"{DURATION}_count", model=MODEL, state="cancelled") == 0


def test_a_job_a_worker_completes_is_observed_as_completed(
    planner: Planner, redis_server: RedisServer
) -> None:
    job = planner.client.create_job()
    planner.client.add_lines(job.id, lines(4))
    planner.client.seal(job.id)
    config = EngineConfig.create(MODEL, device="cpu", dtype="float32", max_model_len=512)
    worker = Worker(WorkerSettings(redis_url=redis_server.url, model=MODEL), LLMEngine(config))
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(
            "the completed job's duration",
            lambda: planner.value(f"{DURATION}_count", model=MODEL, state="completed") == 1,
        )
    finally:
        stop.set()
        thread.join(timeout=60)
    done = planner.client.get(job.id)
    assert done.state == pb.JOB_STATE_COMPLETED
    assert planner.value(f"{DURATION}_sum", model=MODEL, state="completed") == pytest.approx(
        done.finished_at - done.created_at
    )
    # buckets are cumulative; nothing took two days
    assert planner.value(f"{DURATION}_bucket", model=MODEL, state="completed", le="172800.0") == 1


def test_a_planner_serving_no_metrics_follows_no_jobs() -> None:
    metrics = PlannerMetrics()
    ended = JobRecord("job_x", MODEL, JobState.COMPLETED, created_at=1.0, finished_at=2.0)
    metrics.follow_jobs(lambda job_id: ended)
    metrics.job_sealed(ended.id)  # nothing would ever read it back: not kept
    assert metrics.observe_ended_jobs() == 0
