"""The Redis schema's promises, against a real redis-server: first write wins, counters move once,
leases are kept alive and taken over only when their worker stops."""

from __future__ import annotations

import time

import numpy as np
from services_testbed import RedisServer
from store_by_hand import MODEL, started_job, store_on

from prefixgrove.jobs.redis_store.queue import GroupQueue, Lease
from prefixgrove.jobs.redis_store.schema import (
    GroupRecord,
    JobKeys,
    JobState,
    RequestRecord,
    ResultRecord,
)


def ok(i: int) -> ResultRecord:
    return ResultRecord(False, f'{{"n": {i}}}')


def test_records_round_trip() -> None:
    record = RequestRecord(
        "id-1", "chat", {"max_tokens": 3, "stop": ["x"]}, np.arange(7, dtype=np.int32)
    )
    back = RequestRecord.decode(record.encode())
    assert (back.custom_id, back.endpoint, back.params) == (
        "id-1",
        "chat",
        {"max_tokens": 3, "stop": ["x"]},
    )
    assert back.prompt_token_ids.tolist() == list(range(7))
    assert GroupRecord.decode(GroupRecord(32, [4, 1]).encode()) == GroupRecord(32, [4, 1])


def test_first_result_write_wins_and_counts_once(redis_server: RedisServer) -> None:
    store = store_on(redis_server)
    job_id = started_job(store, MODEL, 3, [GroupRecord(0, [0, 1, 2])])
    assert store.write_results(job_id, [(0, ok(0), 5), (1, ResultRecord(True, "{}"), 0)]) == 2
    assert store.write_results(job_id, [(0, ResultRecord(False, "second"), 9), (1, ok(1), 9)]) == 0
    job = store.get_job(job_id)
    assert (job.completed, job.failed, job.completion_tokens) == (1, 1, 5)
    assert store.read_results(job_id, 0, 3) == [ok(0), ResultRecord(True, "{}"), None]
    assert job.state == JobState.IN_PROGRESS


def test_job_completes_when_the_last_request_is_answered(redis_server: RedisServer) -> None:
    store = store_on(redis_server)
    job_id = started_job(store, MODEL, 2, [GroupRecord(0, [0, 1])])
    store.write_results(job_id, [(0, ok(0), 1)])
    assert store.job_state(job_id) == JobState.IN_PROGRESS
    store.write_results(job_id, [(1, ok(1), 1)])
    job = store.get_job(job_id)
    assert job.state == JobState.COMPLETED and job.finished_at > 0


def test_a_group_finishes_once(redis_server: RedisServer) -> None:
    store = store_on(redis_server)
    job_id = started_job(store, MODEL, 2, [GroupRecord(0, [0]), GroupRecord(0, [1])])
    store.mark_leased(job_id, "0")
    assert store.finish_group(job_id, "0") is True
    assert store.finish_group(job_id, "0") is False
    job = store.get_job(job_id)
    assert job.groups_done == 1 and store.job_queue(job).depth == 1


def test_idempotency_key_returns_the_first_job(redis_server: RedisServer) -> None:
    store = store_on(redis_server)
    first, created = store.create_job(MODEL, "uid-1")
    again, created_again = store.create_job(MODEL, "uid-1")
    assert created and not created_again and again.id == first.id


def test_cancel_waits_for_leased_groups(redis_server: RedisServer) -> None:
    store = store_on(redis_server)
    job_id = started_job(store, MODEL, 2, [GroupRecord(0, [0]), GroupRecord(0, [1])])
    store.mark_leased(job_id, "0")
    assert store.cancel(job_id) == JobState.CANCELLING
    store.finish_group(job_id, "0")
    assert store.job_state(job_id) == JobState.CANCELLED


def test_queue_depth_counts_waiting_and_leased(redis_server: RedisServer) -> None:
    store = store_on(redis_server)
    started_job(store, MODEL, 3, [GroupRecord(0, [0]), GroupRecord(0, [1]), GroupRecord(0, [2])])
    queue = GroupQueue(store.r, MODEL, "w1", lease_timeout_s=5)
    [lease] = queue.take(1, 0)
    store.mark_leased(lease.job_id, lease.group_id)  # as a worker does before running it
    depth = store.model_queue(MODEL)
    assert (depth.waiting, depth.leased, depth.depth) == (2, 1, 3)
    assert store.model_queue().depth == 3


def test_keepalive_holds_a_lease_and_takeover_follows_a_dead_worker(
    redis_server: RedisServer,
) -> None:
    store = store_on(redis_server)
    started_job(store, MODEL, 2, [GroupRecord(0, [0]), GroupRecord(0, [1])])
    alive = GroupQueue(store.r, MODEL, "alive", lease_timeout_s=1)
    dead = GroupQueue(store.r, MODEL, "dead", lease_timeout_s=1)
    other = GroupQueue(store.r, MODEL, "other", lease_timeout_s=1)
    [kept] = alive.take(1, 0)
    [dropped] = dead.take(1, 0)
    for _ in range(4):  # 1.2 s: past the timeout for the silent one
        time.sleep(0.3)
        alive.keep_alive()
    taken = other.take(2, 0)
    assert [lease.entry_id for lease in taken] == [dropped.entry_id]
    assert taken[0].deliveries == 2
    alive.keep_alive()
    assert alive.lost() == [] and kept.entry_id in alive._held


def test_a_lease_taken_over_is_reported_lost(redis_server: RedisServer) -> None:
    store = store_on(redis_server)
    started_job(store, MODEL, 1, [GroupRecord(0, [0])])
    slow = GroupQueue(store.r, MODEL, "slow", lease_timeout_s=1)
    [lease] = slow.take(1, 0)
    time.sleep(1.1)
    GroupQueue(store.r, MODEL, "fast", lease_timeout_s=1).take(1, 0)
    slow.keep_alive()
    assert slow.lost() == [lease]


def given_back_and_taken_again(server: RedisServer) -> tuple[Lease, Lease]:
    """One worker takes the only group and gives it back cleanly; the next one takes it."""
    store = store_on(server)
    started_job(store, MODEL, 1, [GroupRecord(0, [0])])
    leaving = GroupQueue(store.r, MODEL, "leaving", lease_timeout_s=30)
    [lease] = leaving.take(1, 0)
    leaving.release(lease, failed=False)
    [again] = GroupQueue(store.r, MODEL, "next", lease_timeout_s=30).take(1, 0)
    return lease, again


def test_release_hands_the_group_to_the_next_taker_at_once(redis_server: RedisServer) -> None:
    lease, again = given_back_and_taken_again(redis_server)
    assert (again.entry_id, again.job_id, again.group_id) == (
        lease.entry_id,
        lease.job_id,
        lease.group_id,
    )


def test_a_clean_release_keeps_the_delivery_count(redis_server: RedisServer) -> None:
    lease, again = given_back_and_taken_again(redis_server)
    assert (lease.deliveries, again.deliveries) == (1, 1)


def test_a_failed_release_counts_one_more_delivery_each_time(redis_server: RedisServer) -> None:
    store = store_on(redis_server)
    started_job(store, MODEL, 1, [GroupRecord(0, [0])])
    seen = []
    for attempt in range(4):
        queue = GroupQueue(store.r, MODEL, f"w{attempt}", lease_timeout_s=30)
        [lease] = queue.take(1, 0)
        seen.append(lease.deliveries)
        queue.release(lease, failed=True)
    assert seen == [1, 2, 3, 4]


def test_trimming_keeps_every_entry_still_leased_or_waiting(redis_server: RedisServer) -> None:
    store = store_on(redis_server)
    started_job(store, MODEL, 4, [GroupRecord(0, [i]) for i in range(4)])
    queue = GroupQueue(store.r, MODEL, "w", lease_timeout_s=30)
    first, second = queue.take(2, 0)
    store.finish_group(second.job_id, second.group_id)
    queue.ack(second)  # done; the first is still leased, two are waiting
    assert store.trim_queues() == 0
    store.finish_group(first.job_id, first.group_id)
    queue.ack(first)
    assert store.trim_queues() == 1  # the last delivered entry stays as the stream's bookmark
    assert store.model_queue(MODEL).depth == 2
    assert len(queue.take(5, 0)) == 2


def test_a_failed_ingest_frees_its_idempotency_key(redis_server: RedisServer) -> None:
    store = store_on(redis_server)
    first, _ = store.create_job(MODEL, "uid-2")
    store.fail_ingest(first.id, "ingest_interrupted", "the planner stopped during the upload")
    again, created = store.create_job(MODEL, "uid-2")
    assert created and again.id != first.id


def test_freeing_a_key_never_frees_another_jobs_claim_on_it(redis_server: RedisServer) -> None:
    store = store_on(redis_server)
    first, _ = store.create_job(MODEL, "uid-3")
    store.fail_ingest(first.id, "empty_file", "no lines")
    second, _ = store.create_job(MODEL, "uid-3")
    store.fail_ingest(first.id, "empty_file", "no lines")  # a late second failure of the old job
    assert store.create_job(MODEL, "uid-3") == (second, False)


def test_after_redis_lost_a_job_workers_recreate_none_of_its_keys(
    redis_server: RedisServer,
) -> None:
    store = store_on(redis_server)
    job_id = started_job(store, MODEL, 2, [GroupRecord(0, [0, 1])])
    redis_server.client().flushall()  # Redis restarted without persistence
    store.mark_leased(job_id, "0")
    assert store.write_results(job_id, [(0, ResultRecord(False, "{}"), 3)]) == 0
    assert store.finish_group(job_id, "0") is False
    assert redis_server.client().keys("*") == []
    assert store.get_job(job_id) is None


def test_the_remains_of_a_job_record_are_no_job(redis_server: RedisServer) -> None:
    store = store_on(redis_server)
    redis_server.client().hset(JobKeys("job_gone").results, "0", "o{}")
    redis_server.client().hset(JobKeys("job_gone").job, "completed", 1)
    assert store.get_job("job_gone") is None
