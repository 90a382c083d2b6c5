"""A finished job's keys expire after the retention the planner was given; a running job's never."""

from __future__ import annotations

import numpy as np
import pytest
from services_testbed import RedisServer
from store_by_hand import MODEL, started_job, store_on

from prefixgrove import settings
from prefixgrove.jobs.redis_store.schema import (
    GroupRecord,
    JobKeys,
    JobState,
    RequestRecord,
    ResultRecord,
)
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.settings import PlannerSettings

RETENTION_S = 3600


def queued_job(store: JobStore, requests: int = 2) -> tuple[str, str]:
    """A job with an idempotency key, its requests written and queued one a group, one leased."""
    key = f"idem-{store.r.dbsize()}"
    units = [GroupRecord(0, [i]) for i in range(requests)]
    job_id = started_job(store, MODEL, requests, units, key)
    record = RequestRecord("c", "completions", {}, np.arange(3, dtype=np.int32))
    store.r.hset(
        JobKeys(job_id).requests, mapping={str(i): record.encode() for i in range(requests)}
    )
    store.mark_leased(job_id, "0")
    return job_id, f"pg:idem:{key}"


def ttls(store: JobStore, job_id: str, idem: str) -> dict[str, int]:
    """TTL of every key the job owns that exists."""
    keys = [*JobKeys(job_id).all(), idem]
    return {k: int(store.r.ttl(k)) for k in keys if store.r.exists(k)}


def answer(store: JobStore, job_id: str, indices: range) -> None:
    store.write_results(job_id, [(i, ResultRecord(False, "{}"), 1) for i in indices])


@pytest.fixture
def store(redis_server: RedisServer) -> JobStore:
    return store_on(redis_server, retention_s=RETENTION_S)


def test_a_running_job_keeps_its_keys(store: JobStore) -> None:
    job_id, idem = queued_job(store)
    answer(store, job_id, range(1))
    store.finish_group(job_id, "0")
    found = ttls(store, job_id, idem)
    assert store.job_state(job_id) == JobState.IN_PROGRESS
    assert len(found) == 6  # job, req, grp, res, done, idem; nothing is leased now
    assert set(found.values()) == {-1}


def test_a_completed_job_expires_every_key_it_owns(store: JobStore) -> None:
    job_id, idem = queued_job(store)
    answer(store, job_id, range(2))
    assert store.job_state(job_id) == JobState.COMPLETED
    store.finish_group(job_id, "0")  # the last group acknowledged after the job completed
    found = ttls(store, job_id, idem)
    assert {JobKeys(job_id).job, JobKeys(job_id).done, idem} <= set(found)
    assert len(found) == 6 and all(0 < ttl <= RETENTION_S for ttl in found.values())


def test_a_cancelled_job_expires_and_so_does_a_result_written_after_the_cancel(
    store: JobStore,
) -> None:
    job_id, idem = queued_job(store)
    assert store.cancel(job_id) == JobState.CANCELLING
    assert set(ttls(store, job_id, idem).values()) == {-1}
    store.finish_group(job_id, "0")
    assert store.job_state(job_id) == JobState.CANCELLED
    answer(store, job_id, range(1))  # a worker's last result lands after the cancel
    found = ttls(store, job_id, idem)
    assert JobKeys(job_id).results in found
    assert all(0 < ttl <= RETENTION_S for ttl in found.values())


def test_a_failed_job_expires(store: JobStore) -> None:
    job, _ = store.create_job(MODEL, "failing")
    store.fail_job(job.id, "ingest_interrupted", "the planner stopped")
    found = ttls(store, job.id, "pg:idem:failing")
    assert len(found) == 2 and all(0 < ttl <= RETENTION_S for ttl in found.values())


def test_an_expired_job_leaves_the_job_list(store: JobStore) -> None:
    job_id, _ = queued_job(store)
    store.cancel(job_id)
    store.finish_group(job_id, "0")
    store.r.delete(*JobKeys(job_id).all())  # what the expiry does
    assert store.list_jobs(10) == ([], False)
    assert store.r.zcard("pg:jobs") == 0


def test_retention_zero_keeps_a_finished_job(redis_server: RedisServer) -> None:
    store = store_on(redis_server, retention_s=0)
    job_id, idem = queued_job(store)
    answer(store, job_id, range(2))
    assert store.job_state(job_id) == JobState.COMPLETED
    assert set(ttls(store, job_id, idem).values()) == {-1}


def test_retention_setting_defaults_to_a_week_and_reads_the_environment() -> None:
    assert PlannerSettings().job_retention_s == 7 * 24 * 3600
    env = {"PREFIXGROVE_JOB_RETENTION_S": "0"}
    assert settings.load(PlannerSettings, env=env).job_retention_s == 0
    with pytest.raises(ValueError, match="job_retention_s=-1"):
        PlannerSettings(job_retention_s=-1)
