"""The aggregate queue depth the autoscaler reads counts only groups some worker will run: groups of
cancelled, failed or completed jobs count nothing, whatever is still in the stream."""

from __future__ import annotations

import threading
from itertools import pairwise

import pytest
from services_testbed import RedisServer

from prefixgrove.jobs.ingest import JobPlan
from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.queue import GroupQueue, Lease
from prefixgrove.jobs.redis_store.schema import GroupRecord, JobKeys, JobState, ResultRecord
from prefixgrove.jobs.redis_store.store import JobStore, QueueDepth

MODEL = "m"


@pytest.fixture
def store(redis_server: RedisServer) -> JobStore:
    return JobStore(connect(redis_server.url))


def job_with_groups(store: JobStore, groups: int, model: str = MODEL) -> str:
    """A started job of one request per group."""
    job, _ = store.create_job(model)
    store.r.hset(JobKeys(job.id).job, "total", groups)
    units = [GroupRecord(0, [i]) for i in range(groups)]
    store.queue_plan(job.id, model, JobPlan(units, 0, groups))
    return job.id


def lease(store: JobStore, queue: GroupQueue, count: int) -> list[Lease]:
    leases = queue.take(count, 0)
    for held in leases:
        store.mark_leased(held.job_id, held.group_id)
    return leases


def stream_length(store: JobStore) -> int:
    return int(store.r.xlen(f"pg:queue:{MODEL}"))


def test_cancelling_a_job_nobody_read_drops_its_groups_from_the_depth(store: JobStore) -> None:
    cancelled = job_with_groups(store, 3)
    job_with_groups(store, 2)
    assert store.model_queue(MODEL) == QueueDepth(5, 0)
    assert store.cancel(cancelled) == JobState.CANCELLED
    assert store.model_queue(MODEL) == QueueDepth(2, 0)
    assert stream_length(store) == 5  # its entries are still queued; no worker will run them


def test_a_cancelling_job_counts_nothing_while_a_worker_still_holds_its_group(
    store: JobStore,
) -> None:
    cancelled = job_with_groups(store, 3)
    other = job_with_groups(store, 2)
    [held] = lease(store, GroupQueue(store.r, MODEL, "w", lease_timeout_s=30), 1)
    assert held.job_id == cancelled
    assert store.cancel(cancelled) == JobState.CANCELLING
    assert store.model_queue(MODEL) == QueueDepth(2, 0)
    store.finish_group(held.job_id, held.group_id)
    assert store.job_state(cancelled) == JobState.CANCELLED
    assert store.model_queue(MODEL) == QueueDepth(2, 0)
    assert store.model_queue() == QueueDepth(2, 0)
    assert store.r.smembers(f"pg:active:{MODEL}") == {other.encode()}


def test_a_completed_job_contributes_nothing_before_its_groups_are_acknowledged(
    store: JobStore,
) -> None:
    done = job_with_groups(store, 2)
    job_with_groups(store, 1)
    store.write_results(done, [(i, ResultRecord(False, "{}"), 1) for i in range(2)])
    assert store.job_state(done) == JobState.COMPLETED
    assert store.model_queue(MODEL) == QueueDepth(1, 0)


def test_a_failed_job_contributes_nothing(store: JobStore) -> None:
    failed = job_with_groups(store, 4)
    store.fail_job(failed, "internal", "the job could not run")
    assert store.model_queue(MODEL) == QueueDepth(0, 0)


def test_depth_follows_leases_takeover_release_and_trimming(store: JobStore) -> None:
    job_with_groups(store, 4)
    dead = GroupQueue(store.r, MODEL, "dead", lease_timeout_s=1)
    alive = GroupQueue(store.r, MODEL, "alive", lease_timeout_s=1)
    first, second = lease(store, dead, 2)
    assert store.model_queue(MODEL) == QueueDepth(2, 2)
    store.finish_group(first.job_id, first.group_id)
    dead.ack(first)
    store.trim_queues()  # deletes entries: the depth does not depend on the stream's lag
    assert store.model_queue(MODEL) == QueueDepth(2, 1)
    threading.Event().wait(1.1)  # the dead worker's lease times out
    [taken] = lease(store, alive, 1)
    assert taken.group_id == second.group_id
    assert store.model_queue(MODEL) == QueueDepth(2, 1)
    alive.release(taken, failed=False)
    assert store.model_queue(MODEL) == QueueDepth(3, 0)


def test_depth_only_falls_while_workers_lease_and_finish_concurrently(
    redis_server: RedisServer, store: JobStore
) -> None:
    job_with_groups(store, 60)
    job_with_groups(store, 30, model="other")  # another model's queue is not counted

    def work(name: str) -> None:
        mine = JobStore(connect(redis_server.url))
        queue = GroupQueue(mine.r, MODEL, name, lease_timeout_s=30)
        while leases := lease(mine, queue, 2):
            for held in leases:
                mine.finish_group(held.job_id, held.group_id)
                queue.ack(held)

    workers = [threading.Thread(target=work, args=(f"w{i}",)) for i in range(3)]
    seen = [store.model_queue(MODEL)]  # before any worker runs (one may finish groups at once)
    for thread in workers:
        thread.start()
    while any(t.is_alive() for t in workers):
        seen.append(store.model_queue(MODEL))
    for thread in workers:
        thread.join()
    seen.append(store.model_queue(MODEL))
    depths = [d.depth for d in seen]
    assert depths[0] == 60 and depths[-1] == 0
    assert all(a >= b for a, b in pairwise(depths))
    assert all(0 <= d.leased <= 6 for d in seen)
    assert store.model_queue() == QueueDepth(30, 0)


def test_jobs_queued_before_the_active_set_existed_are_indexed_again(store: JobStore) -> None:
    running = job_with_groups(store, 3)
    finished = job_with_groups(store, 2)
    store.cancel(finished)
    store.r.delete(f"pg:active:{MODEL}")
    assert store.model_queue(MODEL) == QueueDepth(0, 0)
    assert store.index_active_jobs() == 1
    assert store.r.smembers(f"pg:active:{MODEL}") == {running.encode()}
    assert store.model_queue(MODEL) == QueueDepth(3, 0)


def mixed_job(store: JobStore) -> str:
    """A started job of five one-request groups: three of MODEL, then two of `other`."""
    job, _ = store.create_job(MODEL)
    store.r.hset(JobKeys(job.id).job, "total", 5)
    plans = {
        MODEL: JobPlan([GroupRecord(0, [i]) for i in range(3)], 0, 3),
        "other": JobPlan([GroupRecord(0, [i]) for i in range(3, 5)], 0, 2),
    }
    assert store.queue_plans(job.id, plans) == JobState.IN_PROGRESS
    return job.id


def test_a_job_of_two_models_counts_on_each_models_queue_only_its_own_groups(
    store: JobStore,
) -> None:
    mixed_job(store)
    assert int(store.r.xlen(f"pg:queue:{MODEL}")) == 3 and int(store.r.xlen("pg:queue:other")) == 2
    assert store.model_queue(MODEL) == QueueDepth(3, 0)
    assert store.model_queue("other") == QueueDepth(2, 0)
    assert store.model_queue() == QueueDepth(5, 0)
    [held] = lease(store, GroupQueue(store.r, "other", "w", lease_timeout_s=30), 1)
    assert held.group_id == "3"  # the second model's groups follow the first's ids
    assert store.model_queue("other") == QueueDepth(1, 1)
    assert store.model_queue(MODEL) == QueueDepth(3, 0)
    store.finish_group(held.job_id, held.group_id)
    assert store.model_queue("other") == QueueDepth(1, 0)
    assert store.model_queue(MODEL) == QueueDepth(3, 0)


def test_a_cancelled_job_of_two_models_leaves_both_queues_empty(store: JobStore) -> None:
    job_id = mixed_job(store)
    [held] = lease(store, GroupQueue(store.r, "other", "w", lease_timeout_s=30), 1)
    assert store.cancel(job_id) == JobState.CANCELLING
    assert store.model_queue(MODEL) == store.model_queue("other") == QueueDepth(0, 0)
    store.finish_group(held.job_id, held.group_id)
    assert store.job_state(job_id) == JobState.CANCELLED


def test_a_job_of_two_models_is_indexed_again_in_both_active_sets(store: JobStore) -> None:
    job_id = mixed_job(store)
    store.r.delete(f"pg:active:{MODEL}", "pg:active:other")
    assert store.index_active_jobs() == 1
    for model in (MODEL, "other"):
        assert store.r.smembers(f"pg:active:{model}") == {job_id.encode()}
    assert store.model_queue("other") == QueueDepth(2, 0)
