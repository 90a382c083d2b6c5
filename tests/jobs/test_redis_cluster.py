"""The job store and the group queue on a real Redis Cluster of three redis-server processes: jobs
whose keys land on different nodes run through the same calls the planner and the workers make,
and every request is answered exactly once."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis_topologies import RedisClusterProcesses
from services_testbed import shared_prefix_job, wait_until
from store_by_hand import answer, assert_each_answered_once, ingest_in_pairs, planner_and_worker

from prefixgrove.jobs.redis_store import schema
from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.queue import GroupQueue
from prefixgrove.jobs.redis_store.schema import JobKeys, JobState, ResultRecord
from prefixgrove.jobs.redis_store.store import JobStore, QueueDepth
from prefixgrove.jobs.redis_store.uploads import Uploads

MODEL = "m"
RETENTION_S = 3600
REQUESTS = 9  # line 4 is invalid; the other 8 run two to a group


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    processes = RedisClusterProcesses(tmp_path_factory.mktemp("cluster"))
    try:
        processes.start()
        yield processes
    finally:
        processes.kill()


@pytest.fixture
def store(cluster: RedisClusterProcesses) -> JobStore:
    for node in cluster.nodes:
        node.client().flushall()
    return JobStore(connect(cluster.url), retention_s=RETENTION_S)


def node_of(store: JobStore, job_id: str) -> str:
    client: redis.RedisCluster = store.r  # type: ignore[assignment]
    return str(client.get_node_from_key(JobKeys(job_id).job).name)


def jobs_on_every_node(store: JobStore, nodes: int) -> list[str]:
    """Creates jobs (each with an idempotency key) until their keys sit on every node."""
    jobs: dict[str, list[str]] = {}
    for n in range(200):
        job, created = store.create_job(MODEL, idempotency_key=f"key-{n}")
        assert created
        jobs.setdefault(node_of(store, job.id), []).append(job.id)
        if len(jobs) == nodes:
            return [ids[0] for ids in jobs.values()]
    raise AssertionError(f"200 jobs landed on {len(jobs)} of {nodes} nodes")


def ingest(store: JobStore, job_id: str) -> None:
    """What the planner does with a sealed input: requests and errors in, groups queued."""
    state = ingest_in_pairs(store, job_id, MODEL, requests=REQUESTS, invalid=4,
                            custom_id=lambda i: f"{job_id}-{i}")  # fmt: skip
    assert state == JobState.IN_PROGRESS


@pytest.fixture
def jobs(store: JobStore, cluster: RedisClusterProcesses) -> list[str]:
    """A job ingested on each node."""
    jobs = jobs_on_every_node(store, len(cluster.nodes))
    for job_id in jobs:
        ingest(store, job_id)
    return jobs


def work(store: JobStore, queue: GroupQueue, rounds: int = 50) -> int:
    """A worker's loop without an engine: lease groups, answer what is not answered yet, finish
    them; a group of a job that stopped running is finished unanswered. Returns groups done."""
    done = 0
    for _ in range(rounds):
        leases = queue.take(4, block_ms=50)
        if not leases:
            return done
        for lease in leases:
            store.mark_leased(lease.job_id, lease.group_id)
            state = store.job_state(lease.job_id)
            loaded = store.load_group(lease.job_id, lease.group_id)
            if loaded is not None and state is not None and state.runnable:
                answer(store, lease.job_id, *loaded)
            store.finish_group(lease.job_id, lease.group_id)
            queue.ack(lease)
            done += 1
    return done


def assert_answered_once(store: JobStore, job_id: str) -> None:
    job = store.get_job(job_id)
    assert job is not None and job.state == JobState.COMPLETED
    assert (job.total, job.completed, job.failed) == (REQUESTS, REQUESTS - 1, 1)
    assert store.r.hlen(JobKeys(job_id).results) == REQUESTS
    results = store.read_results(job_id, 0, REQUESTS)
    assert all(r is not None for r in results)
    ids = [json.loads(r.line)["custom_id"] for r in results]  # type: ignore[union-attr]
    assert ids == [f"{job_id}-{i}" for i in range(REQUESTS)]


def test_every_key_of_a_job_sits_in_one_slot() -> None:
    keys = JobKeys("job_0123456789abcdef")
    slots = {redis.cluster.key_slot(k.encode()) for k in [*keys.all(), keys.job + ":upload"]}
    assert len(slots) == 1
    assert redis.cluster.key_slot(JobKeys("job_other").job.encode()) not in slots


def test_jobs_on_every_node_are_answered_exactly_once(store: JobStore, jobs: list[str]) -> None:
    assert store.model_queue(MODEL) == QueueDepth(waiting=4 * len(jobs), leased=0)
    store.r.delete(schema.active_key(MODEL))  # jobs queued before the active sets existed
    assert store.index_active_jobs() == len(jobs)
    first = GroupQueue(store.r, MODEL, "w1", lease_timeout_s=60)
    given_back = first.take(2, block_ms=0)
    for lease in given_back:
        store.mark_leased(lease.job_id, lease.group_id)
    assert store.model_queue(MODEL).leased == 2
    for lease in given_back:
        first.release(lease, failed=False)  # a worker stopping hands its groups back
    assert store.model_queue(MODEL) == QueueDepth(waiting=4 * len(jobs), leased=0)
    second = GroupQueue(store.r, MODEL, "w2", lease_timeout_s=60)
    assert work(store, second) == 4 * len(jobs)
    for job_id in jobs:
        assert_answered_once(store, job_id)
    assert store.model_queue(MODEL) == QueueDepth(0, 0)
    assert store.trim_queues() == 4 * len(jobs) - 1  # the last entry delivered stays
    listed, more = store.list_jobs(100)
    assert {j.id for j in listed} >= set(jobs) and not more


def test_a_group_of_a_worker_that_died_is_taken_over_and_nothing_doubles(
    store: JobStore, jobs: list[str]
) -> None:
    dying = GroupQueue(store.r, MODEL, "dying", lease_timeout_s=1)
    for lease in dying.take(3, block_ms=0):  # answers half of each group, then dies
        store.mark_leased(lease.job_id, lease.group_id)
        group, _ = store.load_group(lease.job_id, lease.group_id)  # type: ignore[misc]
        index = group.indices[0]
        line = json.dumps({"custom_id": f"{lease.job_id}-{index}"})
        store.write_results(lease.job_id, [(index, ResultRecord(False, line), 2)])
    survivor = GroupQueue(store.r, MODEL, "survivor", lease_timeout_s=1)
    work(store, survivor)  # the new groups; the dead worker's are not idle long enough yet
    wait_until(lambda: work(store, survivor) > 0, 10, "the dead worker's groups to be taken over")
    for job_id in jobs:
        assert_answered_once(store, job_id)
        assert store.get_job(job_id).completion_tokens == 2 * (REQUESTS - 1)  # type: ignore[union-attr]


def test_a_cancel_waits_for_the_leased_groups_then_every_key_expires(
    store: JobStore, cluster: RedisClusterProcesses
) -> None:
    job_id = jobs_on_every_node(store, len(cluster.nodes))[-1]
    ingest(store, job_id)
    queue = GroupQueue(store.r, MODEL, "w", lease_timeout_s=60)
    lease = queue.take(1, block_ms=0)[0]
    store.mark_leased(job_id, lease.group_id)
    assert store.cancel(job_id) == JobState.CANCELLING
    assert store.model_queue(MODEL) == QueueDepth(0, 0)  # a cancelling job runs nothing more
    store.finish_group(job_id, lease.group_id)
    assert store.job_state(job_id) == JobState.CANCELLED
    idem = schema.idempotency_key(store.get_job(job_id).idempotency_key)  # type: ignore[union-attr]
    ttls = {k: store.r.ttl(k) for k in [*JobKeys(job_id).all(), idem] if store.r.exists(k)}
    assert idem in ttls
    assert JobKeys(job_id).job in ttls and all(0 < t <= RETENTION_S for t in ttls.values())


def test_an_idempotency_key_names_its_job_until_the_retention_ends(store: JobStore) -> None:
    job, created = store.create_job(MODEL, idempotency_key="once")
    again, created_again = store.create_job(MODEL, idempotency_key="once")
    assert created and not created_again and again.id == job.id
    ingest(store, job.id)
    work(store, GroupQueue(store.r, MODEL, "w", lease_timeout_s=60))
    assert_answered_once(store, job.id)
    assert 0 < store.r.ttl("pg:idem:once") <= RETENTION_S  # expires with the job's keys
    assert store.create_job(MODEL, idempotency_key="once")[0].id == job.id
    store.r.delete(*JobKeys(job.id).all())  # what the retention does to the job
    replaced, created_now = store.create_job(MODEL, idempotency_key="once")
    assert created_now and replaced.id != job.id
    assert store.r.get("pg:idem:once") == replaced.id.encode()


def test_a_failed_ingest_frees_its_idempotency_key(store: JobStore) -> None:
    job, _ = store.create_job(MODEL, idempotency_key="retry-me")
    uploads = Uploads(store.r)
    uploads.claim_ingest(job.id, "planner-a")
    assert uploads.orphaned_ingests() == [job.id]  # planner-a never beat
    store.fail_ingest(job.id, "ingest_interrupted", "the planner stopped")
    uploads.release_ingest(job.id)
    assert store.job_state(job.id) == JobState.FAILED
    assert store.r.exists("pg:idem:retry-me") == 0
    retried, created = store.create_job(MODEL, idempotency_key="retry-me")
    assert created and retried.id != job.id


def test_a_command_waits_for_its_node_to_restart(
    store: JobStore, cluster: RedisClusterProcesses
) -> None:
    job_id = jobs_on_every_node(store, len(cluster.nodes))[0]
    node = next(n for n in cluster.nodes if n.address == node_of(store, job_id))
    node.kill()
    restart = threading.Timer(1.5, node.start)
    restart.start()
    try:
        job, created = store.create_job(MODEL, idempotency_key="after-restart")  # waits
    finally:
        restart.join()
    assert created and store.get_job(job.id) == job
    wait_until(cluster.healthy, 30, "the cluster to be whole again")


def test_a_planner_and_a_worker_on_the_cluster_run_a_job(
    cluster: RedisClusterProcesses, store: JobStore, tmp_path: Path
) -> None:
    from prefixgrove_proto import planner_pb2 as pb

    with planner_and_worker(cluster.url, tmp_path) as client:
        job = client.submit_file(shared_prefix_job(tmp_path / "in.jsonl", 24, with_errors=True))
        wait_until(lambda: client.get(job.id).state == pb.JOB_STATE_COMPLETED, 240,
                   f"job {job.id} to complete")  # fmt: skip
        assert_each_answered_once(client, job.id, tmp_path, total=27)
