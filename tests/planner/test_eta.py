"""A job's live ETA: its plan until a request finishes, then the plan's remaining work at the
job's measured rate; unknown without either, 0 once ended; watchers are not woken by it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import grpc
import pytest
from services_testbed import MODEL, RedisServer, batch_line, planner_in_process

from prefixgrove.jobs.redis_store.schema import JobRecord, JobState
from prefixgrove.planner.client import PlannerClient
from prefixgrove.planner.eta import UNKNOWN, eta_seconds
from prefixgrove.settings import IngestSettings
from prefixgrove_proto import planner_pb2 as pb
from prefixgrove_proto import planner_pb2_grpc as pb_grpc

PLAN = json.dumps({"devices": {"h100": {"wall_s": 100.0}, "a100": "cannot run"}})


def job(**fields: object) -> JobRecord:
    base = {"id": "job_1", "model": MODEL, "state": JobState.IN_PROGRESS, "total": 10,
            "in_progress_at": 1000.0}  # fmt: skip
    return JobRecord(**{**base, **fields})  # type: ignore[arg-type]


def test_before_any_request_finishes_the_plan_tells_the_eta() -> None:
    assert eta_seconds(job(plan=PLAN), now=1030.0) == pytest.approx(70.0)
    assert eta_seconds(job(plan=PLAN), now=1500.0) == 0.0  # past the plan: not negative


def test_once_requests_finish_the_measured_rate_corrects_the_plan() -> None:
    # 4 of 10 done in 60 s: the 6 left take 90 s at that pace, whatever the plan said
    assert eta_seconds(job(plan=PLAN, completed=3, failed=1), now=1060.0) == pytest.approx(90.0)
    assert eta_seconds(job(completed=5), now=1020.0) == pytest.approx(20.0)


def test_without_a_plan_or_a_finished_request_the_eta_is_unknown() -> None:
    assert eta_seconds(job(), now=1010.0) == UNKNOWN
    assert eta_seconds(job(state=JobState.VALIDATING, plan=PLAN), now=1010.0) == UNKNOWN


def test_an_ended_job_has_nothing_left() -> None:
    for state in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED):
        assert eta_seconds(job(state=state, plan=PLAN), now=1010.0) == 0.0


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[PlannerClient]:
    # Llama-3.1-8B's shapes (the planner loads no weights): a job whose plan takes seconds
    with planner_in_process(redis_server.url, IngestSettings(max_model_len=4096),
                            model="llama-3.1-8b-random") as (_, c):  # fmt: skip
        yield c


def test_a_watcher_is_not_woken_by_the_eta_alone(client: PlannerClient) -> None:
    job_id = client.create_job().id
    body = {"prompt": "Shared words for all of them. " * 4, "max_tokens": 3000, "ignore_eos": True}
    client.add_lines(job_id, [batch_line(f"r{i}", body | {"seed": i}).encode() for i in range(3)])
    sealed = client.seal(job_id)
    assert sealed.eta_s > 0  # it moves with the clock while no worker runs the job
    seen: list[float] = []
    watch = pb_grpc.PlannerStub(client.channel).WatchJob(pb.WatchJobRequest(job_id=job_id))
    reader = threading.Thread(target=lambda: seen.extend(j.eta_s for j in _quietly(watch)),
                              daemon=True)  # fmt: skip
    reader.start()
    reader.join(1.5)  # several polls of an unchanged job
    watch.cancel()
    assert len(seen) == 1


def _quietly(watch: Iterator[pb.Job]) -> Iterator[pb.Job]:
    """The watch's jobs until it is cancelled."""
    try:
        yield from watch
    except grpc.RpcError:
        return


def test_status_shows_a_running_jobs_eta(capsys: pytest.CaptureFixture[str]) -> None:
    from prefixgrove.cli_client import _show

    running = pb.Job(id="job_1", state=pb.JOB_STATE_IN_PROGRESS, eta_s=200.0)
    _show(running, as_json=False)
    unknown = pb.Job(id="job_2", state=pb.JOB_STATE_IN_PROGRESS, eta_s=UNKNOWN)
    _show(unknown, as_json=False)
    shown = capsys.readouterr().out.splitlines()
    assert shown[0].endswith("ETA 3.3 min") and "ETA" not in shown[1]


def test_the_planner_serves_each_running_jobs_eta_until_it_ends(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import urllib.request

    from polling import wait_for
    from prometheus_client.parser import text_string_to_metric_families
    from services_testbed import free_port

    from prefixgrove.planner import metrics as planner_metrics

    monkeypatch.setattr(planner_metrics, "_REFRESH_S", 0.2)
    port = free_port()

    def eta_of(job_id: str) -> float | None:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        samples = (s for f in text_string_to_metric_families(text.decode()) for s in f.samples)
        name = "prefixgrove_planner_job_eta_seconds"
        return next((s.value for s in samples if s.name == name and s.labels == {"job": job_id}), None)  # fmt: skip

    with planner_in_process(redis_server.url, IngestSettings(max_model_len=4096),
                            model="llama-3.1-8b-random", metrics_port=port) as (_, c):  # fmt: skip
        body = {"prompt": "Shared words. " * 8, "max_tokens": 3000, "ignore_eos": True}
        job_id = c.create_job().id
        c.add_lines(job_id, [batch_line(f"r{i}", body).encode() for i in range(2)])
        planned = c.seal(job_id).plan.devices[0].wall_s
        wait_for("the job's ETA", lambda: eta_of(job_id) is not None)
        assert 0 < (eta_of(job_id) or 0) <= planned
        c.cancel(job_id)
        wait_for("the ended job's ETA to go", lambda: eta_of(job_id) is None)
