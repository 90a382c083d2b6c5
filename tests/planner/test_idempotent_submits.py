"""One idempotency key gives one job holding its input exactly once: a submit resumed after its
client died mid-upload, two submits at once and a submit of a sealed job all end in one job of the
input's lines, each at its own index; a key reused for another input is refused. A real planner
over gRPC on loopback, a real redis-server behind it."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from services_testbed import RedisServer, batch_line, planner_in_process

from prefixgrove.cli import main as cli_main
from prefixgrove.jobs.redis_store.schema import JobKeys, RequestRecord
from prefixgrove.jobs.redis_store.uploads import DIGEST_BYTES
from prefixgrove.planner import client as client_module
from prefixgrove.planner.client import PlannerClient, PlannerError, PlannerRejected
from prefixgrove.planner.input_digest import LINE_DIGEST_BYTES, fingerprint, line_digest
from prefixgrove.planner.server import PlannerServer
from prefixgrove_proto import planner_pb2 as pb

KEY = "batchjob-7"


@pytest.fixture
def planner(redis_server: RedisServer) -> Iterator[tuple[PlannerServer, PlannerClient]]:
    with planner_in_process(redis_server.url) as (server, client):
        yield server, client


@pytest.fixture
def client(planner: tuple[PlannerServer, PlannerClient]) -> PlannerClient:
    return planner[1]


def lines(n: int, tag: str = "") -> list[bytes]:
    prefix = "Shared instructions for every request. " * 4
    return [
        batch_line(f"r{i}", {"prompt": f"{prefix}{tag}item {i}", "max_tokens": 2}).encode()
        for i in range(n)
    ]


def held_custom_ids(redis_server: RedisServer, job_id: str) -> list[str]:
    """The custom_id of each request the job holds, in line order."""
    raw = redis_server.client().hgetall(JobKeys(job_id).requests)
    records = {int(k): RequestRecord.decode(v) for k, v in raw.items()}
    return [records[i].custom_id for i in sorted(records)]


def partly_uploaded(client: PlannerClient, content: list[bytes], sent: int) -> pb.Job:
    """A job under KEY declared to hold `content`, holding its first `sent` lines: its client
    stopped there."""
    job = client.create_job(idempotency_key=KEY, fingerprint=fingerprint(content))
    client.add_lines(job.id, content[:sent], skip=0)
    return job


def counted(content: list[bytes]) -> tuple[Callable[[], Iterator[bytes]], list[int]]:
    """An input for submit_lines, and how many times it was read."""
    reads = [0]

    def read() -> Iterator[bytes]:
        reads[0] += 1
        yield from content

    return read, reads


def test_a_submit_after_the_client_died_mid_upload_resumes_its_job_with_each_line_once(
    client: PlannerClient, redis_server: RedisServer
) -> None:
    content = lines(1000)
    dead = partly_uploaded(client, content, sent=375)  # its client died there
    job = client.submit_lines(lambda: iter(content), idempotency_key=KEY)
    assert job.id == dead.id and job.state == pb.JOB_STATE_IN_PROGRESS
    assert job.request_counts.total == 1000
    assert held_custom_ids(redis_server, job.id) == [f"r{i}" for i in range(1000)]
    assert list(client.results(job.id, 0, pb.RESULT_KIND_ERROR)) == []  # no duplicate_custom_id


def test_a_submit_under_the_key_of_a_sealed_job_gets_it_back_without_sending_a_line(
    client: PlannerClient,
) -> None:
    first = client.submit_lines(lambda: iter(lines(20)), idempotency_key=KEY)
    read, reads = counted(lines(20))
    again = client.submit_lines(read, idempotency_key=KEY)
    assert again.id == first.id and again.request_counts.total == 20
    assert reads == [1]  # read for its fingerprint only


def test_two_submits_at_once_under_one_key_make_one_job_holding_the_input_once(
    planner: tuple[PlannerServer, PlannerClient],
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, _ = planner
    monkeypatch.setattr(client_module, "_CHUNK_BYTES", 4096)  # many chunks, interleaved
    content = lines(600)
    start = threading.Barrier(2)
    jobs: list[pb.Job] = []

    def submit() -> None:
        client = PlannerClient(f"127.0.0.1:{server.port}")
        try:
            start.wait()
            jobs.append(client.submit_lines(lambda: iter(content), idempotency_key=KEY))
        finally:
            client.close()

    threads = [threading.Thread(target=submit) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(jobs) == 2 and jobs[0].id == jobs[1].id
    assert held_custom_ids(redis_server, jobs[0].id) == [f"r{i}" for i in range(600)]


def test_a_submit_of_another_input_under_a_used_key_is_refused_naming_the_key(
    client: PlannerClient,
) -> None:
    client.submit_lines(lambda: iter(lines(20)), idempotency_key=KEY)
    with pytest.raises(PlannerRejected) as refused:
        client.submit_lines(lambda: iter(lines(20, tag="other ")), idempotency_key=KEY)
    assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert repr(KEY) in str(refused.value)


def test_a_submit_of_another_input_while_the_first_still_uploads_is_refused(
    client: PlannerClient,
) -> None:
    first = partly_uploaded(client, lines(20), sent=5)
    with pytest.raises(PlannerRejected) as refused:
        client.submit_lines(lambda: iter(lines(20, tag="other ")), idempotency_key=KEY)
    assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert client.get(first.id).request_counts.total == 5


def test_a_line_sent_again_that_differs_from_the_one_held_is_refused_and_adds_nothing(
    client: PlannerClient,
) -> None:
    job = client.create_job(idempotency_key=KEY)  # no fingerprint: the lines are compared
    client.add_lines(job.id, lines(10), skip=0)
    with pytest.raises(PlannerRejected) as refused:
        client.add_lines(job.id, [*lines(5), *lines(10, tag="other ")[5:]], skip=0)
    assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert "request line 5 differs" in str(refused.value) and repr(KEY) in str(refused.value)
    assert client.add_lines(job.id, lines(12), skip=0).total == 12


def test_a_stream_starting_past_the_lines_held_is_refused(client: PlannerClient) -> None:
    job = client.create_job()
    client.add_lines(job.id, lines(4), skip=0)
    with pytest.raises(PlannerRejected) as refused:
        client.add_lines(job.id, lines(10), skip=6)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "send from line 4" in str(refused.value)


def test_a_seal_before_the_whole_declared_input_arrived_is_refused_and_the_job_takes_the_rest(
    client: PlannerClient,
) -> None:
    content = lines(30)
    job = partly_uploaded(client, content, sent=10)
    with pytest.raises(PlannerError) as refused:
        client.seal(job.id)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "holds 10 of the 30 request lines" in str(refused.value)
    client.add_lines(job.id, content, skip=0)
    sealed = client.seal(job.id)
    assert sealed.state == pb.JOB_STATE_IN_PROGRESS and sealed.request_counts.total == 30


def test_a_job_holding_other_lines_than_its_declared_input_fails_and_frees_its_key(
    client: PlannerClient,
) -> None:
    content = lines(10)
    job = client.create_job(idempotency_key=KEY, fingerprint=fingerprint(content))
    client.add_lines(job.id, lines(10, tag="other "))  # appended, unplaced: an old client
    with pytest.raises(PlannerError) as failed:
        client.seal(job.id)
    assert failed.value.code == grpc.StatusCode.ABORTED
    assert client.get(job.id).error.code == "input_mismatch"
    again = client.submit_lines(lambda: iter(content), idempotency_key=KEY)
    assert again.id != job.id and again.state == pb.JOB_STATE_IN_PROGRESS


def test_the_cli_submit_exits_1_when_the_key_gives_back_a_cancelled_job(
    planner: tuple[PlannerServer, PlannerClient],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server, client = planner
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines(5)) + b"\n")
    client.cancel(client.submit_file(path, idempotency_key=KEY).id)
    argv = ["submit", str(path), "--planner", f"127.0.0.1:{server.port}", "--json",
            "--idempotency-key", KEY]  # fmt: skip
    assert cli_main(argv) == 1
    assert json.loads(capsys.readouterr().out)["state"] == "JOB_STATE_CANCELLED"


def test_the_store_keeps_line_digests_of_the_size_the_planner_makes() -> None:
    assert DIGEST_BYTES == LINE_DIGEST_BYTES == len(line_digest(b"{}"))
