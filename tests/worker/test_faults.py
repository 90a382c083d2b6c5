"""A request that makes the engine fail is failed alone, and a group that keeps killing workers is
failed after the configured deliveries, while the groups leased beside it spend one delivery on it:
real worker processes (the real engine, wrapped so that one poisoned request makes it fail) against
a real redis-server."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faulty_worker import FAULT
from run_tags import as_job
from services_testbed import (
    MAX_MODEL_LEN,
    MODEL,
    Process,
    RedisServer,
    service_env,
    wait_until,
)

from prefixgrove.jobs.ingest import JobPlan
from prefixgrove.jobs.redis_store.alone_note import AloneNote
from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.queue import GroupQueue, Lease
from prefixgrove.jobs.redis_store.schema import (
    GroupRecord,
    JobKeys,
    JobState,
    RequestRecord,
    ResultRecord,
)
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.worker.isolation_policy import DIED_ALONE

POISON = 3  # a token id no other prompt here holds
SCRIPT = str(Path(__file__).with_name("faulty_worker.py"))
PREFIX_LEN = 32
PARAMS = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def store(redis_server: RedisServer) -> JobStore:
    return JobStore(connect(redis_server.url))


def start_faulty_worker(redis: RedisServer, log: Path, fault: str, *extra: str) -> Process:
    args = ["--redis-url", redis.url, "--model", MODEL, "--device", "cpu", "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--poison-token", str(POISON), "--fault", fault,
            *extra]  # fmt: skip
    return Process(args, log, service_env(), program=(SCRIPT,))


def queue_job(
    store: JobStore,
    groups: int,
    per_group: int,
    poisoned: frozenset[int] = frozenset(),
    params: dict[str, Any] = PARAMS,
    prefix_len: int = PREFIX_LEN,
) -> str:
    """A started job of `groups` groups sharing a prefix each; the requests at `poisoned` line
    indices hold the poison token."""
    job, _ = store.create_job(MODEL)
    records, units = {}, []
    for g in range(groups):
        prefix = np.arange(10 + g, 10 + g + prefix_len, dtype=np.int32)
        indices = list(range(g * per_group, (g + 1) * per_group))
        for i in indices:
            own = [POISON] if i in poisoned else [100 + i]
            tokens = np.concatenate([prefix, np.array([*own, 200 + i], dtype=np.int32)])
            records[str(i)] = RequestRecord(f"r{i}", "completions", params, tokens).encode()
        units.append(GroupRecord(prefix_len, indices))
    store.r.hset(JobKeys(job.id).requests, mapping=records)
    store.r.hset(JobKeys(job.id).job, "total", groups * per_group)
    store.queue_plan(job.id, MODEL, JobPlan(units, 0, len(units)))
    return job.id


def results(store: JobStore, job_id: str) -> dict[int, ResultRecord]:
    raw = store.r.hgetall(JobKeys(job_id).results)
    return {int(k): ResultRecord.decode(v) for k, v in raw.items()}


def completed(store: JobStore, *job_ids: str) -> bool:
    return all(store.job_state(j) == JobState.COMPLETED for j in job_ids)


def test_a_request_the_engine_raises_on_fails_alone_and_the_rest_completes(
    redis_server: RedisServer, store: JobStore, tmp_path: Path, workers: list[Process]
) -> None:
    poisoned = queue_job(store, groups=3, per_group=4, poisoned=frozenset({5}))
    other = queue_job(store, groups=2, per_group=4)  # another job's groups in the same engine
    worker = start_faulty_worker(redis_server, tmp_path / "worker.log", "raise",
                                 "--max-groups-in-flight", "8")  # fmt: skip
    workers.append(worker)
    wait_until(lambda: completed(store, poisoned, other), 240, "both jobs to complete")
    got = results(store, poisoned)
    assert sorted(got) == list(range(12))  # one result per request
    assert [i for i, r in got.items() if r.is_error] == [5]
    error = json.loads(got[5].line)
    assert error["custom_id"] == "r5" and error["error"]["code"] == "worker_failed"
    assert FAULT in error["error"]["message"]
    assert (
        not any(r.is_error for r in results(store, other).values())
        and len(results(store, other)) == 8
    )
    assert worker.proc.poll() is None, worker.text()[-3000:]  # it isolated the fault, no crash
    assert "gave back" not in worker.text()


def workers_until_done(
    redis: RedisServer, store: JobStore, job_id: str, tmp_path: Path, workers: list[Process],
    *extra: str,
) -> int:  # fmt: skip
    """Starts dying workers one after another until the job completes; returns how many ran."""
    for attempt in range(8):
        worker = start_faulty_worker(redis, tmp_path / f"worker{attempt}.log", "die",
                                     "--lease-timeout-s", "1", *extra)  # fmt: skip
        workers.append(worker)
        wait_until(lambda w=worker: completed(store, job_id) or w.proc.poll() is not None, 240,
                   "the worker to die on the group or the job to complete")  # fmt: skip
        if completed(store, job_id):
            return attempt + 1
    pytest.fail(f"job {job_id} still not complete after 8 workers")


def test_a_group_that_keeps_killing_workers_fails_after_max_deliveries(
    redis_server: RedisServer, store: JobStore, tmp_path: Path, workers: list[Process]
) -> None:
    job_id = queue_job(store, groups=1, per_group=3, poisoned=frozenset({1}))
    started = workers_until_done(redis_server, store, job_id, tmp_path, workers,
                                 "--max-deliveries", "2")  # fmt: skip
    assert started == 3  # two deliveries died; the third failed the group
    got = results(store, job_id)
    assert sorted(got) == [0, 1, 2] and all(r.is_error for r in got.values())
    codes = {json.loads(r.line)["error"]["code"] for r in got.values()}
    assert codes == {"worker_failed"}
    assert "stopped 2 workers" in json.loads(got[0].line)["error"]["message"]


@pytest.mark.slow(
    reason="the poison group of test_groups_leased_beside_a_poison_group_spend_one_delivery_on_it"
    " takes this path (two deaths with its group, two alone, failed alone at delivery 5)"
)
def test_a_request_that_kills_workers_alone_twice_is_failed_alone(
    redis_server: RedisServer, store: JobStore, tmp_path: Path, workers: list[Process]
) -> None:
    job_id = queue_job(store, groups=1, per_group=4, poisoned=frozenset({1}))
    started = workers_until_done(redis_server, store, job_id, tmp_path, workers)
    # two die with the whole group, the third and the fourth alone on request 1, the fifth fails it
    assert started == 5
    got = results(store, job_id)
    assert sorted(got) == [0, 1, 2, 3]
    assert [i for i, r in got.items() if r.is_error] == [1]
    error = json.loads(got[1].line)["error"]
    assert error["code"] == "worker_failed" and error["message"] == DIED_ALONE


def highest_deliveries(workers: list[Process]) -> dict[str, int]:
    """Group id -> the highest delivery any worker took it over at, from the workers' logs."""
    highest: dict[str, int] = {}
    for worker in workers:
        for group, delivery in re.findall(r"took over group (\S+) of job \S+ \(delivery (\d+)\)",
                                          worker.text()):  # fmt: skip
            highest[group] = max(highest.get(group, 0), int(delivery))
    return highest


def test_groups_leased_beside_a_poison_group_spend_one_delivery_on_it(
    redis_server: RedisServer, store: JobStore, tmp_path: Path, workers: list[Process]
) -> None:
    job_id = queue_job(store, groups=4, per_group=3, poisoned=frozenset({1}))
    workers_until_done(redis_server, store, job_id, tmp_path, workers,
                       "--max-groups-in-flight", "8")  # fmt: skip
    got = results(store, job_id)
    assert sorted(got) == list(range(12))
    assert [i for i, r in got.items() if r.is_error] == [1]
    assert json.loads(got[1].line)["error"]["message"] == DIED_ALONE
    highest = highest_deliveries(workers)
    assert len(highest) == 4, highest  # the first worker held all four when it died
    assert sorted(highest.values()) == [2, 2, 2, 5], highest  # only the poison's went on


def fail_deliveries(store: JobStore, failures: int) -> Lease:
    """Takes the only queued group and gives it back as failed, `failures` times."""
    for attempt in range(failures):
        queue = GroupQueue(store.r, MODEL, f"failing{attempt}", lease_timeout_s=30)
        [lease] = queue.take(1, 0)
        queue.release(lease, failed=True)
    return lease


def test_a_request_running_alone_at_one_death_runs_again_and_answers(
    redis_server: RedisServer, store: JobStore, tmp_path: Path, workers: list[Process]
) -> None:
    job_id = queue_job(store, groups=1, per_group=3)
    lease = fail_deliveries(store, 3)
    # as if the third delivery's worker was killed from outside while request 1 ran alone
    store.mark_alone(job_id, lease.group_id, AloneNote(1, lease.deliveries))
    workers.append(start_faulty_worker(redis_server, tmp_path / "worker.log", "die"))
    wait_until(lambda: completed(store, job_id), 240, "the job to complete")
    got = results(store, job_id)
    assert sorted(got) == [0, 1, 2] and not any(r.is_error for r in got.values())
    # the last one noted: request 2, no strike of its own, the group's one death blamed on request 1
    assert store.ran_alone(job_id, lease.group_id) == AloneNote(2, 4, strikes=0, blamed=1)


def test_deaths_that_caught_a_request_alone_do_not_count_against_max_deliveries(
    redis_server: RedisServer, store: JobStore, tmp_path: Path, workers: list[Process]
) -> None:
    job_id = queue_job(store, groups=1, per_group=4, poisoned=frozenset({2}))
    lease = fail_deliveries(store, 4)
    # the fourth delivery's worker was killed from outside while request 0 ran alone
    store.mark_alone(job_id, lease.group_id, AloneNote(0, lease.deliveries))
    started = workers_until_done(redis_server, store, job_id, tmp_path, workers)
    # deliveries 5 and 6 die on request 2 alone; the 7th (past max_deliveries=5) fails it alone
    assert started == 3
    got = results(store, job_id)
    assert sorted(got) == [0, 1, 2, 3]
    assert [i for i, r in got.items() if r.is_error] == [2]


def test_a_request_run_alone_writes_the_same_bytes_as_in_its_group(
    redis_server: RedisServer, store: JobStore, tmp_path: Path, workers: list[Process]
) -> None:
    params = {**PARAMS, "max_tokens": 6, "logprobs": 3}
    alone = queue_job(store, groups=1, per_group=4, params=params, prefix_len=96)
    fail_deliveries(store, 2)  # its next delivery runs it request by request
    grouped = queue_job(store, groups=1, per_group=4, params=params, prefix_len=96)
    worker = start_faulty_worker(redis_server, tmp_path / "worker.log", "die")
    workers.append(worker)
    wait_until(lambda: completed(store, alone, grouped), 240, "both jobs to complete")
    assert "running its requests one at a time" in worker.text()
    got_alone, got_grouped = results(store, alone), results(store, grouped)
    assert sorted(got_alone) == sorted(got_grouped) == [0, 1, 2, 3]
    assert all(not r.is_error and "top_logprobs" in r.line for r in got_grouped.values())
    # the same bytes but the run tag of the ids, which is each job's own
    assert [as_job(got_alone[i].line, grouped) for i in range(4)] == [
        got_grouped[i].line for i in range(4)
    ]
