"""A worker stopped while its Redis is gone exits within its stop timeout instead of retrying Redis
for a minute (or draining for two), with a real worker process and a redis-server killed -9."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from services_testbed import MODEL, Process, RedisServer, start_worker, wait_until

from prefixgrove.jobs.ingest import JobPlan
from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.schema import GroupRecord, JobKeys, RequestRecord
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.settings import WorkerSettings

QUEUE = f"pg:queue:{MODEL}"
# A worker that kept retrying Redis would take about a minute (two when draining); the bound
# only has to tell that apart, with room for a busy machine's slow process exit.
SLACK_S = 15.0


def queue_long_group(store: JobStore) -> str:
    """One group of two requests that decode for far longer than the test waits."""
    job, _ = store.create_job(MODEL)
    params = {"max_tokens": 900, "temperature": 0.0, "ignore_eos": True, "detokenize": False}
    records = {
        str(i): RequestRecord(
            f"r{i}", "completions", params, np.arange(1 + i, 40 + i, dtype=np.int32)
        )
        for i in range(2)
    }
    store.r.hset(JobKeys(job.id).requests, mapping={k: v.encode() for k, v in records.items()})
    store.r.hset(JobKeys(job.id).job, "total", 2)
    store.queue_plan(job.id, MODEL, JobPlan([GroupRecord(0, [0, 1])], 0, 1))
    return job.id


def test_sigterm_with_redis_gone_exits_within_the_stop_timeout(
    redis_server: RedisServer, tmp_path: Path, workers: list[Process]
) -> None:
    store = JobStore(connect(redis_server.url))
    queue_long_group(store)
    worker = start_worker(redis_server.url, tmp_path / "worker.log", "--consumer", "w")
    workers.append(worker)
    held = lambda: bool(store.r.xpending_range(QUEUE, "workers", "-", "+", 5, consumername="w"))  # noqa: E731
    wait_until(held, 90, "the worker to hold the group")
    redis_server.kill()
    time.sleep(1.5)  # the worker is now retrying Redis
    assert stop_with_redis_gone(worker, WorkerSettings().stop_timeout_s) == 0, worker.text()[-2000:]
    assert "giving up" in worker.text()  # it stopped waiting on Redis rather than timing out


def test_sigterm_with_redis_gone_and_no_work_exits_within_a_shorter_stop_timeout(
    redis_server: RedisServer, tmp_path: Path, workers: list[Process]
) -> None:
    worker = start_worker(redis_server.url, tmp_path / "worker.log", "--consumer", "idle",
                          "--stop-timeout-s", "3")  # fmt: skip
    workers.append(worker)
    client = redis_server.client()
    reading = lambda: any(c.get("cmd") == "xreadgroup" for c in client.client_list())  # noqa: E731
    wait_until(reading, 90, "the worker to wait for groups")
    redis_server.kill()
    time.sleep(1.5)
    assert stop_with_redis_gone(worker, 3.0) == 0, worker.text()[-2000:]


def stop_with_redis_gone(worker: Process, stop_timeout_s: float) -> int:
    """SIGTERM, then the exit code; fails if the worker outlives its stop timeout by more than
    a busy machine explains."""
    worker.kill(signal.SIGTERM)
    try:
        return worker.wait(stop_timeout_s + SLACK_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {stop_timeout_s + SLACK_S:.0f}s after SIGTERM:\n"
                    f"{worker.text()[-2000:]}")  # fmt: skip
