"""Several planner replicas on one Redis serve any call of any job: an upload's state is in Redis,
so a job is created, streamed and sealed through any replica, and a replica killed mid-upload
loses only that upload, which the client submits again.

A Kubernetes Service gives its users one name; a reconnect after a pod died may land on another
pod. The client here gets what a name that resolves to several pods gives gRPC: one target
(`ipv4:A,B`) whose channel connects to the first address that answers, and reconnects to the next
one when that one dies.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from services_testbed import (
    MAX_MODEL_LEN,
    MODEL,
    RedisServer,
    ServiceStack,
    batch_line,
    planner_in_process,
    service_stack,
    shared_prefix_job,
    wait_until,
)

from prefixgrove.jobs.ingest import JobIngestor, JobPlan
from prefixgrove.jobs.redis_store import schema
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.jobs.redis_store.uploads import UploadKeys, Uploads, rebuild_plan
from prefixgrove.jobs.tokenize import PromptTokenizer
from prefixgrove.planner import client as client_module
from prefixgrove.planner import sealing
from prefixgrove.planner.client import PlannerClient, PlannerError
from prefixgrove.planner.server import UPLOAD_FAILED_WITHIN_S
from prefixgrove.settings import IngestSettings
from prefixgrove_proto import planner_pb2 as pb

JOB_TIMEOUT_S = 180


# --- the upload ledger in Redis, in process -------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer(MODEL, max_model_len=MAX_MODEL_LEN)


def job_lines(path: Path, n: int, with_errors: bool = False) -> list[bytes]:
    return shared_prefix_job(path, n, with_errors=with_errors).read_bytes().splitlines()


def plans_of_one_replica(
    redis_server: RedisServer, tokenizers: dict[str, PromptTokenizer], lines: list[bytes]
) -> tuple[dict[str, JobPlan], dict[str, JobPlan]]:
    """A job whose `lines` one replica took, 40 at a time, writing them to Redis as the planner
    does: its plans rebuilt from Redis alone, and the plans that replica holds."""
    store, uploads = JobStore(redis_server.client()), Uploads(redis_server.client())
    settings = IngestSettings(max_model_len=MAX_MODEL_LEN)
    job, _ = store.create_job(MODEL)
    uploads.open(job.id)
    ingestor = JobIngestor(tokenizers, settings, uploads.ledger(job.id))
    for start in range(0, len(lines), 40):
        batch = ingestor.add(lines[start : start + 40])
        store.write_requests(job.id, batch, ingestor.total, ingestor.prompt_tokens)
    return rebuild_plan(uploads, job.id, ingestor.total, settings, MODEL), ingestor.plan()


def test_a_plan_rebuilt_from_redis_equals_the_plan_of_the_replica_that_took_every_line(
    redis_server: RedisServer, tokenizer: PromptTokenizer, tmp_path: Path
) -> None:
    lines = job_lines(tmp_path / "in.jsonl", 300, with_errors=True)
    rebuilt, cached = plans_of_one_replica(redis_server, {MODEL: tokenizer}, lines)
    assert cached[MODEL].num_groups > 1 and cached[MODEL].prefix_tokens_saved > 0
    assert rebuilt == cached


def test_a_mixed_jobs_plans_rebuilt_from_redis_equal_those_of_the_replica_that_took_every_line(
    redis_server: RedisServer, tokenizer: PromptTokenizer, tmp_path: Path
) -> None:
    lines = job_lines(tmp_path / "in.jsonl", 120, with_errors=True)
    for i in range(0, len(lines), 3):  # a third of the lines (every document) for the second
        obj = json.loads(lines[i]) if lines[i].startswith(b'{"custom_id": "req') else None
        if obj is not None:
            obj["body"]["model"] = "second"
            lines[i] = json.dumps(obj).encode()
    tokenizers = {MODEL: tokenizer, "second": tokenizer}  # one source under two served names
    rebuilt, cached = plans_of_one_replica(redis_server, tokenizers, lines)
    assert list(cached) == [MODEL, "second"] and cached["second"].num_groups > 0
    assert rebuilt == cached


def test_two_replicas_streaming_one_job_never_give_two_lines_one_index(
    redis_server: RedisServer, tokenizer: PromptTokenizer, tmp_path: Path
) -> None:
    uploads = Uploads(redis_server.client())
    uploads.open("job_shared")
    settings = IngestSettings(max_model_len=MAX_MODEL_LEN)
    replicas = [
        JobIngestor({MODEL: tokenizer}, settings, uploads.ledger("job_shared")) for _ in range(2)
    ]
    lines = job_lines(tmp_path / "in.jsonl", 60)
    lines.append(batch_line("req-3", {"prompt": "taken on the other replica"}).encode())
    batches = [replicas[k % 2].add(lines[k * 7 : (k + 1) * 7]) for k in range(-(-len(lines) // 7))]
    indices = [r.index for b in batches for r, _ in b.requests] + [
        e.index for b in batches for e in b.errors
    ]
    assert sorted(indices) == list(range(len(lines)))
    [duplicate] = [e for b in batches for e in b.errors]
    assert (duplicate.index, duplicate.code) == (60, "duplicate_custom_id")
    assert uploads.ledger("job_shared").counts().lines == 61


def test_an_upload_left_idle_on_a_live_replica_is_expired_by_another(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    with (
        planner_in_process(redis_server.url) as (server, client),
        planner_in_process(redis_server.url) as (other_server, _),
    ):
        job = client.create_job(idempotency_key="idle-upload")
        client.add_lines(job.id, job_lines(tmp_path / "in.jsonl", 3))  # then nothing more
        other = other_server.service
        assert other.expire_idle_uploads(900.0) == []
        assert other.expire_idle_uploads(900.0, now=time.time() + 901) == [job.id]
        failed = client.get(job.id)
        assert (failed.state, failed.error.code) == (pb.JOB_STATE_FAILED, "upload_abandoned")
        assert redis_server.client().exists(*UploadKeys(job.id).all()) == 0
        server.service.forget_ended_uploads()
        assert job.id not in server.service.ingests
        assert client.create_job(idempotency_key="idle-upload").id != job.id


def test_an_upload_whose_sealer_stopped_is_expired_and_one_sealed_by_a_live_planner_is_not(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    with planner_in_process(redis_server.url) as (server, client):
        service = server.service
        jobs = [client.create_job() for _ in range(2)]
        for job, sealer in zip(jobs, ("planner-gone", service.instance), strict=True):
            client.add_lines(job.id, job_lines(tmp_path / "in.jsonl", 3))
            assert service.uploads.claim_seal(job.id, sealer).counts is not None
        assert service.expire_idle_uploads(900.0, now=time.time() + 901) == [jobs[0].id]
        assert client.get(jobs[1].id).state == pb.JOB_STATE_VALIDATING


def test_a_seal_that_finds_lines_taken_but_never_stored_fails_the_job_for_a_new_upload(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the lines never come: the seal's wait for streams still storing theirs only delays the end
    monkeypatch.setattr(sealing, "_STORE_WAIT_S", 1.0)
    with planner_in_process(redis_server.url) as (server, client):
        job = client.create_job(idempotency_key="lost-lines")
        client.add_lines(job.id, job_lines(tmp_path / "in.jsonl", 4))
        server.service.uploads.ledger(job.id).reserve(3)  # a replica that died mid-chunk
        with pytest.raises(PlannerError) as lost:
            client.seal(job.id)
        assert lost.value.code == grpc.StatusCode.ABORTED
        assert client.get(job.id).error.code == "ingest_interrupted"
        assert client.create_job(idempotency_key="lost-lines").id != job.id


# --- two planner processes, one worker --------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceStack]:
    d = tmp_path_factory.mktemp("replicas")
    with service_stack(d, planners=("a", "b"), workers={"w1": ()}) as stack:
        yield stack


@pytest.fixture
def replicas(cluster: ServiceStack) -> ServiceStack:
    """The module's replicas, each of them running (a test may have killed one)."""
    for name, planner in cluster.planners.items():
        if planner.proc.poll() is not None:
            cluster.start_planner(name)
    return cluster


def wait_done(client: PlannerClient, job_id: str) -> pb.Job:
    wait_until(lambda: client.get(job_id).state == pb.JOB_STATE_COMPLETED, JOB_TIMEOUT_S,
               f"job {job_id} to complete")  # fmt: skip
    return client.get(job_id)


def custom_ids(client: PlannerClient, job_id: str) -> list[str]:
    return [json.loads(r.line)["custom_id"] for r in client.results(job_id, 0, pb.RESULT_KIND_ALL)]


def test_a_job_streamed_into_one_replica_is_sealed_and_served_by_the_other(
    replicas: ServiceStack, tmp_path: Path
) -> None:
    a, b = replicas.client("a"), replicas.client("b")
    job = a.create_job(metadata={"via": "a"})
    a.add_lines(job.id, job_lines(tmp_path / "in.jsonl", 40))
    sealed = b.seal(job.id)
    assert sealed.state == pb.JOB_STATE_IN_PROGRESS and sealed.prefix_tokens_saved > 0
    assert b.get(job.id).metadata["via"] == "a"
    assert job.id in {j.id for j in a.list()} & {j.id for j in b.list()}
    wait_done(a, job.id)
    assert custom_ids(a, job.id) == custom_ids(b, job.id) == [f"req-{i}" for i in range(40)]


def test_a_job_uploaded_half_through_each_replica_runs_every_line_once(
    replicas: ServiceStack, tmp_path: Path
) -> None:
    a, b = replicas.client("a"), replicas.client("b")
    lines = job_lines(tmp_path / "in.jsonl", 60)
    job = b.create_job()
    a.add_lines(job.id, lines[:30])
    assert b.add_lines(job.id, lines[30:]).total == 60
    sealed = a.seal(job.id)  # a took half the lines: it groups the job from Redis
    assert sealed.request_counts.total == 60 and sealed.groups_total >= 1
    done = wait_done(b, job.id)
    assert done.request_counts == pb.RequestCounts(total=60, completed=60, failed=0)
    assert custom_ids(a, job.id) == [f"req-{i}" for i in range(60)]


def test_a_cancel_through_the_other_replica_ends_the_upload(
    replicas: ServiceStack, tmp_path: Path
) -> None:
    a, b = replicas.client("a"), replicas.client("b")
    job = a.create_job()
    a.add_lines(job.id, job_lines(tmp_path / "in.jsonl", 5))
    assert b.cancel(job.id).state == pb.JOB_STATE_CANCELLED
    with pytest.raises(PlannerError) as refused:
        a.add_lines(job.id, job_lines(tmp_path / "more.jsonl", 2))
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    r = replicas.redis.client()
    assert r.exists(*UploadKeys(job.id).all()) == 0 and r.hexists(schema.INGESTING, job.id) == 0


class _PausedSource:
    """Request lines that stop after `pause_after` lines of the first upload until `resume` is set;
    every later upload, and the reading for the input's fingerprint before the first, gets them
    all at once."""

    def __init__(self, lines: list[bytes], pause_after: int) -> None:
        self.lines = lines
        self.pause_after = pause_after
        self.resume = threading.Event()
        self.reads = 0

    def __call__(self) -> Iterator[bytes]:
        self.reads += 1
        first_upload = self.reads == 2
        for n, line in enumerate(self.lines):
            if first_upload and n == self.pause_after:
                self.resume.wait()
            yield line


def test_a_replica_killed_mid_upload_loses_only_that_upload(
    replicas: ServiceStack,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(client_module, "_CHUNK_BYTES", 4096)  # several chunks land before the kill
    service = replicas.client("a", "b")  # connects to a first; reconnects to b once a is gone
    source = _PausedSource(job_lines(tmp_path / "in.jsonl", 200), pause_after=100)
    submitted: list[pb.Job] = []
    submit = threading.Thread(
        target=lambda: submitted.append(service.submit_lines(source, idempotency_key="kill-a"))
    )
    left_on_a = replicas.client("a").create_job()  # an upload whose client goes away
    replicas.client("a").add_lines(left_on_a.id, job_lines(tmp_path / "left.jsonl", 5))
    b = replicas.client("b")
    submit.start()
    wait_until(lambda: any(j.idempotency_key == "kill-a" and j.request_counts.total > 0
                           for j in b.list()), 60, "the upload to reach replica a")  # fmt: skip
    replicas.planners["a"].kill(signal.SIGKILL)
    replicas.planners["a"].wait(10)
    source.resume.set()
    submit.join(60)
    [job] = submitted
    done = wait_done(b, job.id)
    assert done.request_counts == pb.RequestCounts(total=200, completed=200, failed=0)
    assert custom_ids(b, job.id) == [f"req-{i}" for i in range(200)]
    # Resumed in place on b, or (when a died with lines taken and not stored) started over as a
    # clean job, the broken one failed having run nothing.
    for broken in [j for j in b.list() if j.idempotency_key == "kill-a" and j.id != job.id]:
        assert (broken.state, broken.error.code) == (pb.JOB_STATE_FAILED, "ingest_interrupted")
        assert broken.request_counts.completed == broken.request_counts.failed == 0
    retries = [
        r.getMessage() for r in caplog.records if "submitting the input again" in r.getMessage()
    ]
    assert "attempt 2 of 3" in retries[0]  # the one line a retry adds to stderr
    wait_until(lambda: b.get(left_on_a.id).state == pb.JOB_STATE_FAILED,
               UPLOAD_FAILED_WITHIN_S + 10, "the upload left on a to fail")  # fmt: skip
    assert b.get(left_on_a.id).error.code == "ingest_interrupted"
