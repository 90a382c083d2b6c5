"""An upload that meets a Redis out of memory (`maxmemory` reached under `noeviction`) fails its job
with RESOURCE_EXHAUSTED and frees its idempotency key; once Redis has room, the same submit makes a
clean job; a live planner's heartbeat is renewed meanwhile. A real planner over gRPC on loopback, a
real redis-server with a small maxmemory."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from services_testbed import RedisServer, batch_line, planner_in_process

from prefixgrove.jobs.redis_store.schema import JobKeys
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.planner.client import PlannerClient, PlannerUnavailable
from prefixgrove_proto import planner_pb2 as pb

KEY = "too-big-for-redis"
ROOM_BYTES = 256 << 10  # what the job may take of Redis: far less than its lines need


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[PlannerClient]:
    with planner_in_process(redis_server.url) as (_, client):
        yield client


def lines(n: int) -> list[bytes]:
    text = "A long shared document for every request of the job. " * 8
    return [
        batch_line(f"r{i}", {"prompt": f"{text}item {i}", "max_tokens": 2}).encode()
        for i in range(n)
    ]


def fill_up(redis_server: RedisServer, room: int = ROOM_BYTES) -> None:
    """Redis refuses writes once it holds `room` bytes more than now (0: from now on)."""
    r = redis_server.client()
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", used + room if room else 1)


def submit_beyond_room(
    client: PlannerClient, redis_server: RedisServer, content: list[bytes]
) -> PlannerUnavailable:
    """The refusal of a submit under KEY of `content`, which Redis has room for a part of."""
    fill_up(redis_server)
    with pytest.raises(PlannerUnavailable) as refused:
        client.submit_lines(lambda: iter(content), idempotency_key=KEY, attempts=1)
    return refused.value


def test_an_upload_that_meets_redis_out_of_memory_fails_its_job_and_frees_its_key(
    client: PlannerClient, redis_server: RedisServer
) -> None:
    refused = submit_beyond_room(client, redis_server, lines(3000))
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Redis is out of memory" in str(refused) and repr(KEY) in str(refused)
    r = redis_server.client()
    assert r.exists(f"pg:idem:{KEY}") == 0
    [failed] = client.list()
    assert (failed.state, failed.error.code) == (pb.JOB_STATE_FAILED, "redis_out_of_memory")
    assert r.exists(JobKeys(failed.id).requests) == 0  # its lines made room


def test_once_redis_has_room_the_same_submit_makes_a_clean_job(
    client: PlannerClient, redis_server: RedisServer
) -> None:
    content = lines(3000)
    submit_beyond_room(client, redis_server, content)
    redis_server.client().config_set("maxmemory", 0)
    job = client.submit_lines(lambda: iter(content), idempotency_key=KEY, attempts=1)
    assert job.state == pb.JOB_STATE_IN_PROGRESS and job.request_counts.total == 3000


def test_a_seal_that_meets_redis_out_of_memory_fails_its_job_and_frees_its_key(
    client: PlannerClient, redis_server: RedisServer
) -> None:
    job = client.create_job(idempotency_key=KEY)
    client.add_lines(job.id, lines(20))
    fill_up(redis_server, room=0)
    with pytest.raises(PlannerUnavailable) as refused:
        client.seal(job.id)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert redis_server.client().exists(f"pg:idem:{KEY}") == 0
    failed = client.get(job.id)  # marked failed though Redis is still full
    assert (failed.state, failed.error.code) == (pb.JOB_STATE_FAILED, "redis_out_of_memory")
    redis_server.client().config_set("maxmemory", 0)
    assert client.create_job(idempotency_key=KEY).id != job.id


def test_a_planners_heartbeat_is_renewed_while_redis_is_out_of_memory(
    redis_server: RedisServer,
) -> None:
    store = JobStore(redis_server.client())
    store.heartbeat("planner-a", 5)
    fill_up(redis_server, room=0)
    store.heartbeat("planner-a", 30)  # a planner alive stays alive: its uploads are not failed
    assert redis_server.client().ttl("pg:planner:planner-a") > 5
