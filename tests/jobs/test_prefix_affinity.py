"""Prefix-affine leasing against a real redis-server: a new group goes to the worker that holds its
prefix and is taken there before anything else; it waits for that worker no longer than the
affinity wait; an advertisement that lapsed sends nothing; a dead holder's groups are taken over as
any dead worker's; the planner names the prefixes of two jobs that share a document alike."""

from __future__ import annotations

import time

import numpy as np
import pytest
from services_testbed import RedisServer

from prefixgrove.affinity_settings import AffinitySettings
from prefixgrove.jobs.ingest import JobPlan, plan_groups
from prefixgrove.jobs.prefix_index import PrefixIndex
from prefixgrove.jobs.redis_store.affinity import PrefixAffinity
from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.queue import GroupQueue, Lease
from prefixgrove.jobs.redis_store.schema import GroupRecord, JobKeys
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.settings import IngestSettings, load

MODEL = "m"


def queued_job(store: JobStore, prefixes: list[str]) -> str:
    """A job of one group per prefix name, queued in this order."""
    job, _ = store.create_job(MODEL)
    store.r.hset(JobKeys(job.id).job, "total", len(prefixes))
    units = [GroupRecord(16, [i]) for i in range(len(prefixes))]
    store.queue_plan(job.id, MODEL, JobPlan(units, 0, len(units), prefixes))
    return job.id


def worker(store: JobStore, name: str, lease_timeout_s: float = 30, wait_s: float = 10,
           backlog: int = 8) -> GroupQueue:  # fmt: skip
    affinity = PrefixAffinity(store.r, MODEL, name, ttl_s=lease_timeout_s, wait_s=wait_s,
                              max_prefixes=16, backlog=backlog)  # fmt: skip
    return GroupQueue(store.r, MODEL, name, lease_timeout_s, affinity)


def prefixes(leases: list[Lease]) -> list[str]:
    return [lease.prefix for lease in leases]


@pytest.fixture
def store(redis_server: RedisServer) -> JobStore:
    return JobStore(connect(redis_server.url))


def test_a_new_group_goes_to_the_worker_holding_its_prefix(store: JobStore) -> None:
    a, b = worker(store, "a"), worker(store, "b")
    queued_job(store, ["doc1", "doc2"])
    assert prefixes(a.take(1, 0)) == ["doc1"]
    assert prefixes(b.take(1, 0)) == ["doc2"]
    queued_job(store, ["doc1", "doc2", "doc3"])  # a second job over the same documents
    assert prefixes(b.take(3, 0)) == ["doc2", "doc3"]  # doc1 is sent to a
    assert b.sent == 1
    [taken] = a.take(1, 0)
    assert (taken.prefix, taken.deliveries) == ("doc1", 1)  # sent, not counted as a delivery


def test_a_worker_takes_the_groups_sent_to_it_before_any_other(store: JobStore) -> None:
    a, b = worker(store, "a"), worker(store, "b")
    queued_job(store, ["doc1"])
    a.take(1, 0)
    queued_job(store, ["doc1", "doc2"])
    [kept] = b.take(1, 0)  # doc1 is sent to a, doc2 read in its place
    b.release(kept, failed=False)  # doc2 waits to be claimed by anyone
    queued_job(store, ["doc3"])
    assert prefixes(a.take(1, 0)) == ["doc1"]
    assert prefixes(a.take(2, 0)) == ["doc2", "doc3"]


def test_a_holder_is_sent_no_more_than_its_backlog(store: JobStore) -> None:
    a, b = worker(store, "a"), worker(store, "b", backlog=2)
    queued_job(store, ["doc1"])
    a.take(1, 0)
    queued_job(store, ["doc1"] * 5)
    assert len(b.take(5, 0)) == 3 and b.sent == 2
    assert len(a.take(5, 0)) == 2


def test_a_group_its_holder_does_not_take_goes_to_anyone_after_the_wait(store: JobStore) -> None:
    a, b = worker(store, "a", lease_timeout_s=2, wait_s=0.3), worker(store, "b", 2, 0.3)
    queued_job(store, ["doc1"])
    a.take(1, 0)
    queued_job(store, ["doc1"])
    assert b.take(1, 0) == []
    time.sleep(0.4)
    [taken] = b.take(1, 0)
    assert (taken.prefix, taken.deliveries) == ("doc1", 1)
    assert a.take(1, 0) == []  # taken once


def test_an_expired_advertisement_sends_nothing(store: JobStore) -> None:
    a, b = worker(store, "a", lease_timeout_s=1, wait_s=0.5), worker(store, "b", 1, 0.5)
    queued_job(store, ["doc1"])
    [held] = a.take(1, 0)
    a.ack(held)  # a lives on but refreshes nothing: its advertisement lapses after 1 s
    time.sleep(1.1)
    queued_job(store, ["doc1"])
    assert prefixes(b.take(1, 0)) == ["doc1"] and b.sent == 0


def test_a_dead_holders_groups_are_taken_over_once(store: JobStore) -> None:
    dead, b = worker(store, "dead", lease_timeout_s=1, wait_s=0.5), worker(store, "b", 1, 0.5)
    queued_job(store, ["doc1"])
    [running] = dead.take(1, 0)
    queued_job(store, ["doc1"])
    assert b.take(1, 0) == []  # sent to the holder, which then stops answering
    time.sleep(1.1)
    taken = {lease.entry_id: lease.deliveries for lease in b.take(2, 0)}
    assert len(taken) == 2 and taken[running.entry_id] == 2  # the one sent: 1, never run
    assert sorted(taken.values()) == [1, 2]
    dead.keep_alive()
    assert dead.lost() == [running] and dead.take(2, 0) == []


def test_without_affinity_groups_are_leased_in_queue_order(store: JobStore) -> None:
    a, b = worker(store, "a"), GroupQueue(store.r, MODEL, "b", 30)
    queued_job(store, ["doc1"])
    a.take(1, 0)
    queued_job(store, ["doc1", "doc2"])
    assert prefixes(b.take(2, 0)) == ["doc1", "doc2"]


def test_two_jobs_over_one_document_name_its_prefix_alike() -> None:
    rng = np.random.default_rng(0)
    system, docs = rng.integers(0, 500, 200), [rng.integers(0, 500, 180) for _ in range(2)]
    # each job's own template after the document: their groups' prefixes end 18 tokens apart
    ask, summarize = list(range(7, 27)), [11, 12]

    def job(template: list[int]) -> JobPlan:
        index = PrefixIndex(block_size=16)
        for doc in docs:
            for question in range(3):
                index.add(np.concatenate([system, doc, template, [100 + question] * 20]))
        return plan_groups(index, list(range(6)), IngestSettings())

    first, second = job(ask), job(summarize)
    assert len(set(first.affinity_keys)) == 2 and first.affinity_keys == second.affinity_keys
    assert first.units[0].prefix_len != second.units[0].prefix_len  # not the same prefix whole


def test_affinity_settings_come_from_the_environment_and_wait_half_a_lease_at_most() -> None:
    settings = load(AffinitySettings, env={"PREFIXGROVE_PREFIX_AFFINITY": "false",
                                           "PREFIXGROVE_AFFINITY_WAIT_S": "20"})  # fmt: skip
    assert not settings.prefix_affinity and settings.affinity_wait_s == 20
    assert load(AffinitySettings, env={}).prefix_affinity
    assert settings.wait_s(lease_timeout_s=30) == 15 and settings.wait_s(lease_timeout_s=60) == 20
    with pytest.raises(ValueError, match="affinity_wait_s=0"):
        AffinitySettings(affinity_wait_s=0)
