"""A job through a Sentinel failover: a master, its replica and three Sentinels as real processes;
the master is killed (SIGKILL) with the job half done and the job is finished through the same
client, which follows the Sentinels to the promoted replica; a planner and a worker process do the
same with a job submitted through gRPC.

What is guaranteed (docs/services.md, "Redis Cluster and Sentinel"): the replica receives writes
asynchronously, so the last moments before the kill may be lost. Each script's writes reach it as
one transaction, so what survives is an earlier, consistent state: a result there moved its
counters, a result lost moved none. The workers redo what was lost (a group whose finish or ack
is gone is delivered again, or taken over once its lease times out), skipping the requests already
answered; so every request ends answered exactly once and no counter is moved twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from services_testbed import (
    RedisSentinelProcesses,
    free_port,
    shared_prefix_job,
    start_planner,
    start_worker,
    wait_for_port,
    wait_until,
)

from prefixgrove.jobs.ingest import IngestedBatch, JobPlan
from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.queue import GroupQueue, Lease
from prefixgrove.jobs.redis_store.schema import GroupRecord, JobKeys, JobState, ResultRecord
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.jobs.requests import BatchRequest

MODEL = "m"
REQUESTS = 17  # line 8 is invalid; the other 16 run two to a group
GROUPS = 8


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[RedisSentinelProcesses]:
    processes = RedisSentinelProcesses(tmp_path)
    try:
        processes.start()
        yield processes
    finally:
        processes.kill()


def ingest(store: JobStore, job_id: str) -> None:
    valid = [i for i in range(REQUESTS) if i != 8]
    tokens = np.arange(3, dtype=np.int32)
    requests = [
        (BatchRequest(i, f"req-{i}", "completions", {"max_tokens": 2}, f"p{i}"), tokens)
        for i in valid
    ]
    errors = [RequestError(8, "req-8", "invalid_request", "bad line")]
    store.write_requests(job_id, IngestedBatch(requests, errors), REQUESTS, 3 * len(valid))
    units = [GroupRecord(0, valid[i : i + 2]) for i in range(0, len(valid), 2)]
    store.queue_plan(job_id, MODEL, JobPlan(units, 0, len(units)))


def answer(store: JobStore, lease: Lease, only_first: bool = False) -> None:
    """Answers the group's requests that have no result yet (a worker's flush)."""
    group, records = store.load_group(lease.job_id, lease.group_id)  # type: ignore[misc]
    answered = store.read_answered(lease.job_id, group.indices)
    results = [(i, ResultRecord(False, json.dumps({"custom_id": r.custom_id})), 2)
               for i, r in zip(group.indices, records, strict=True) if i not in answered]  # fmt: skip
    store.write_results(lease.job_id, results[:1] if only_first else results)


def run_group(store: JobStore, queue: GroupQueue, lease: Lease) -> None:
    store.mark_leased(lease.job_id, lease.group_id)
    answer(store, lease)
    store.finish_group(lease.job_id, lease.group_id)
    queue.ack(lease)


def work_until_done(store: JobStore, queue: GroupQueue, job_id: str) -> bool:
    for lease in queue.take(4, block_ms=100):
        run_group(store, queue, lease)
    return store.job_state(job_id) == JobState.COMPLETED


def test_a_job_finishes_through_a_failover_with_every_request_answered_once(
    sentinel: RedisSentinelProcesses,
) -> None:
    store = JobStore(connect(sentinel.url), retention_s=3600)
    job, _ = store.create_job(MODEL, idempotency_key="through-failover")
    ingest(store, job.id)
    # The job itself reached the replica (what the docs call "created in the lost moments" is
    # not covered); only the work below may be lost. Without this a busy machine can lose the
    # whole plan, queue included, and the test would check nothing the guarantee promises.
    assert store.r.execute_command("WAIT", 1, 10_000) == 1
    queue = GroupQueue(store.r, MODEL, "w1", lease_timeout_s=1)
    first = queue.take(4, block_ms=0)
    for lease in first[:3]:
        run_group(store, queue, lease)
    store.mark_leased(first[3].job_id, first[3].group_id)
    answer(store, first[3], only_first=True)  # in flight when the master dies
    old_master = sentinel.master.port

    sentinel.master.kill()
    wait_until(lambda: sentinel.master_port() != old_master, 60, "the replica to be promoted")
    wait_until(lambda: work_until_done(store, queue, job.id), 60, "the job to complete")

    assert sentinel.master_port() == sentinel.replica.port
    done = store.get_job(job.id)
    assert done is not None and done.state == JobState.COMPLETED
    assert (done.completed, done.failed, done.groups_done) == (REQUESTS - 1, 1, GROUPS)
    assert done.completion_tokens == 2 * (REQUESTS - 1)  # no result counted twice
    assert store.r.hlen(JobKeys(job.id).results) == REQUESTS
    results = store.read_results(job.id, 0, REQUESTS)
    ids = [json.loads(r.line)["custom_id"] for r in results]  # type: ignore[union-attr]
    assert ids == [f"req-{i}" for i in range(REQUESTS)]
    assert store.create_job(MODEL, idempotency_key="through-failover")[0].id == job.id


def test_a_planner_and_a_worker_follow_the_failover_and_finish_a_job(
    sentinel: RedisSentinelProcesses, tmp_path: Path
) -> None:
    from prefixgrove.planner.client import PlannerClient
    from prefixgrove_proto import planner_pb2 as pb

    port = free_port()
    planner = start_planner(sentinel.url, port, tmp_path / "planner.log")
    worker = start_worker(sentinel.url, tmp_path / "worker.log", "--consumer", "w1",
                          "--lease-timeout-s", "2", "--max-groups-in-flight", "2")  # fmt: skip
    try:
        wait_for_port(port, planner)
        client = PlannerClient(f"127.0.0.1:{port}")
        lines = shared_prefix_job(tmp_path / "in.jsonl", 60, max_tokens=16, with_errors=True)
        job = client.submit_file(lines)
        counts = lambda: client.get(job.id).request_counts  # noqa: E731
        wait_until(lambda: counts().completed > 5, 120, "the worker to answer some requests")
        assert client.get(job.id).state == pb.JOB_STATE_IN_PROGRESS  # the kill comes mid-job
        old_master = sentinel.master.port
        sentinel.master.kill()
        wait_until(lambda: sentinel.master_port() != old_master, 60, "the replica to be promoted")
        wait_until(lambda: client.get(job.id).state == pb.JOB_STATE_COMPLETED, 240,
                   f"job {job.id} to complete after the failover")  # fmt: skip
        out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
        client.download(job.id, out, err)
        ids = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
        assert len(ids) == len(set(ids)) == counts().completed
        assert len(ids) + len(err.read_text().splitlines()) == counts().total == 63
    finally:
        worker.stop()
        planner.stop()
