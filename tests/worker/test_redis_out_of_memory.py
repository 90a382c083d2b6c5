"""A worker whose writes Redis refuses for lack of memory (`maxmemory` reached under `noeviction`)
keeps running: it keeps its results, takes no new groups, retries after a pause and reports it in
its log, its metrics and /ready; once Redis has room again every result lands exactly once. A real
worker process against a real redis-server whose maxmemory is lowered and raised with CONFIG SET."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from queued_jobs import queue_shared_prefix_job
from redis_topologies import RedisProcess
from services_testbed import MODEL, Process, free_port, start_worker, wait_until

from prefixgrove.engine import EngineConfig, LLMEngine
from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.schema import GIVEN_BACK, JobKeys, JobState, queue_key
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.settings import WorkerSettings
from prefixgrove.worker.runner import Worker

GROUPS, PER_GROUP = 6, 8
QUEUE = queue_key(MODEL)
REFUSED = "redis refuses writes, out of memory"
WORKER_WAIT_S = 300  # a worker process starting and running the job on a busy machine


@pytest.fixture
def redis_noeviction(tmp_path: Path) -> Iterator[RedisProcess]:
    """A redis-server with the noeviction policy and no maxmemory yet."""
    server = RedisProcess(tmp_path / "redis", ["--maxmemory-policy", "noeviction"])
    server.start()
    yield server
    server.kill()


def queue_job(store: JobStore) -> tuple[str, int]:
    """GROUPS groups of PER_GROUP requests sharing a prefix each; returns (job id, requests)."""
    job_id = queue_shared_prefix_job(
        store, MODEL, groups=GROUPS, per_group=PER_GROUP, max_tokens=24, own_tokens=6
    )
    return job_id, GROUPS * PER_GROUP


def ready(port: int) -> int:
    try:
        return int(urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5).status)
    except urllib.error.HTTPError as exc:
        return exc.code


def refusals(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(r"^prefixgrove_worker_redis_refusals_total\{[^}]*\} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def assert_every_result_once(store: JobStore, job_id: str, total: int) -> None:
    wait_until(lambda: store.job_state(job_id) == JobState.COMPLETED, WORKER_WAIT_S, "the job")
    job = store.get_job(job_id)
    assert job is not None and (job.completed, job.failed) == (total, 0)
    answered = store.r.hkeys(JobKeys(job_id).results)
    assert sorted(int(i) for i in answered) == list(range(total))


def test_a_worker_that_redis_refuses_for_memory_keeps_its_results_and_writes_each_once(
    redis_noeviction: RedisProcess, tmp_path: Path, workers: list[Process]
) -> None:
    store = JobStore(connect(f"redis://{redis_noeviction.address}/0"))
    job_id, total = queue_job(store)
    port = free_port()
    # one group at a time, a few requests at once: the results land one after another
    worker = start_worker(f"redis://{redis_noeviction.address}/0", tmp_path / "worker.log",
                          "--consumer", "w", "--metrics-port", str(port),
                          "--max-groups-in-flight", "1", "--max-num-seqs", "2")  # fmt: skip
    workers.append(worker)
    wait_until(lambda: store.r.hlen(JobKeys(job_id).results) > 0, WORKER_WAIT_S, "first results")
    store.r.config_set("maxmemory", 1)  # full: every write that takes memory is refused
    wait_until(lambda: REFUSED in worker.text(), 60, "the worker to meet a full Redis")
    wait_until(lambda: refusals(port) >= 2, 60, "the worker to try again")
    assert worker.proc.poll() is None and ready(port) == 503
    store.r.config_set("maxmemory", 0)
    assert_every_result_once(store, job_id, total)
    wait_until(lambda: ready(port) == 200, 60, "the worker to be ready again")
    assert worker.proc.poll() is None and "Traceback" not in worker.text()


def test_a_group_leased_while_redis_is_full_is_given_back_without_a_delivery_counted(
    redis_noeviction: RedisProcess,
) -> None:
    url = f"redis://{redis_noeviction.address}/0"
    store = JobStore(connect(url))
    queue_job(store)
    config = EngineConfig.create(MODEL, device="cpu", dtype="float32", max_model_len=1024,
                                 max_num_seqs=4)  # fmt: skip
    worker = Worker(WorkerSettings(redis_url=url, model=MODEL, consumer="w"), LLMEngine(config))
    worker.store.ensure_queue(MODEL)
    store.r.config_set("maxmemory", 1)  # full: the group can be read, not noted as leased
    with pytest.raises(redis.OutOfMemoryError):
        worker._iteration(taking=True)
    pending = store.r.xpending_range(QUEUE, "workers", "-", "+", 100)
    assert pending and all(p["consumer"] == GIVEN_BACK.encode() for p in pending)
    assert {p["times_delivered"] for p in pending} == {0}
    assert not worker.flights
