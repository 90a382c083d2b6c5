"""StreamResults with `unanswered`: a finished job's requests that were never answered come as error
lines naming them, so an output and an errors file together account for every request."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from services_testbed import MODEL, RedisServer, batch_line

from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.planner.client import PlannerClient
from prefixgrove.planner.server import build_server
from prefixgrove.settings import IngestSettings, PlannerSettings, SecuritySettings
from prefixgrove_proto import planner_pb2 as pb


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[PlannerClient]:
    planner = PlannerSettings(redis_url=redis_server.url, host="127.0.0.1", port=0, model=MODEL)
    server = build_server(planner, IngestSettings(max_model_len=512), SecuritySettings())
    c = PlannerClient(f"127.0.0.1:{server.port}")
    yield c
    c.close()
    server.stop(0)


def _job(client: PlannerClient) -> str:
    """Four lines, the first not JSON (answered at once as an error), none run by a worker."""
    job = client.create_job()
    valid = [batch_line(f"r{i}", {"prompt": f"item {i}", "max_tokens": 2}).encode() for i in (1, 2)]
    client.add_lines(job.id, [b"nope", *valid, batch_line("r3", {"prompt": "x"}).encode()])
    client.seal(job.id)
    return job.id


def _codes(lines: list[pb.ResultLine]) -> list[tuple[int, str | None, str]]:
    records = [(line.index, json.loads(line.line)) for line in lines]
    return [(i, r["custom_id"], r["error"]["code"]) for i, r in records]


def test_a_cancelled_jobs_unanswered_requests_come_as_cancelled_error_lines(
    client: PlannerClient,
) -> None:
    job_id = _job(client)
    # while the job runs, the stream still stops at the first request not answered
    assert [r.index for r in client.results(job_id, unanswered=True)] == [0]
    client.cancel(job_id)
    lines = list(client.results(job_id, 0, pb.RESULT_KIND_ALL, unanswered=True))
    assert all(line.is_error for line in lines)
    assert _codes(lines) == [
        (0, None, "invalid_json"),
        (1, "r1", "cancelled"),
        (2, "r2", "cancelled"),
        (3, "r3", "cancelled"),
    ]
    assert [r.index for r in client.results(job_id, 2, unanswered=True)] == [2, 3]  # resumed
    assert list(client.results(job_id, 0, pb.RESULT_KIND_OUTPUT, unanswered=True)) == []
    # without the flag the stream passes them over, as before
    assert [r.index for r in client.results(job_id, 0, pb.RESULT_KIND_ALL)] == [0]


def test_a_failed_jobs_unanswered_requests_come_as_not_run_error_lines(
    client: PlannerClient, redis_server: RedisServer
) -> None:
    job_id = _job(client)
    JobStore(connect(redis_server.url)).fail_job(job_id, "internal", "the job could not run")
    lines = list(client.results(job_id, 1, pb.RESULT_KIND_ERROR, unanswered=True))
    assert _codes(lines) == [(1, "r1", "not_run"), (2, "r2", "not_run"), (3, "r3", "not_run")]
    assert "internal: the job could not run" in json.loads(lines[0].line)["error"]["message"]
