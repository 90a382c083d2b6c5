"""The calls a planner and a worker make on the job store, made by hand (no planner, no engine),
and a planner and a worker process on a Redis the test names: what the Redis Cluster and the
Sentinel tests both run, each on its own topology."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from services_testbed import RedisServer, free_port, start_planner, start_worker, wait_for_port

from prefixgrove.jobs.ingest import IngestedBatch, JobPlan
from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.schema import (
    GroupRecord,
    JobKeys,
    JobState,
    RequestRecord,
    ResultRecord,
)
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.jobs.requests import BatchRequest

if TYPE_CHECKING:
    from prefixgrove.planner.client import PlannerClient

MODEL = "m"  # the model the hand-made jobs name


def store_on(server: RedisServer, **options: int) -> JobStore:
    """A job store on `server`'s Redis (`options`: JobStore's own, such as retention_s)."""
    return JobStore(connect(server.url), **options)


def started_job(
    store: JobStore, model: str, total: int, units: list[GroupRecord], idempotency_key: str = ""
) -> str:
    """A running job of `total` requests with its groups `units` queued, as the planner leaves it
    (no request records are written); its id."""
    job, _ = store.create_job(model, idempotency_key)
    store.r.hset(JobKeys(job.id).job, "total", total)
    store.queue_plan(job.id, model, JobPlan(units, 0, len(units)))
    return job.id


def ingest_in_pairs(
    store: JobStore,
    job_id: str,
    model: str,
    *,
    requests: int,
    invalid: int,
    custom_id: Callable[[int], str],
) -> JobState:
    """What the planner does with a sealed input of `requests` lines, line `invalid` a bad one:
    the requests (3 tokens each) and the error in, the valid ones queued two to a group. Returns
    the state the job is left in."""
    valid = [i for i in range(requests) if i != invalid]
    tokens = np.arange(3, dtype=np.int32)
    batch = IngestedBatch(
        [(BatchRequest(i, custom_id(i), "completions", {"max_tokens": 2}, f"p{i}"), tokens)
         for i in valid],
        [RequestError(invalid, custom_id(invalid), "invalid_request", "bad line")],
    )  # fmt: skip
    store.write_requests(job_id, batch, total=requests, prompt_tokens=3 * len(valid))
    units = [GroupRecord(0, valid[i : i + 2]) for i in range(0, len(valid), 2)]
    return store.queue_plan(job_id, model, JobPlan(units, 0, len(units)))


def answer(
    store: JobStore,
    job_id: str,
    group: GroupRecord,
    records: list[RequestRecord],
    first_only: bool = False,
) -> None:
    """A worker's flush: a result for each of the group's requests that has none yet (or for the
    first of them), its custom_id as the line, 2 completion tokens."""
    answered = store.read_answered(job_id, group.indices)
    results = [(i, ResultRecord(False, json.dumps({"custom_id": r.custom_id})), 2)
               for i, r in zip(group.indices, records, strict=True) if i not in answered]  # fmt: skip
    store.write_results(job_id, results[:1] if first_only else results)


@contextmanager
def planner_and_worker(redis_url: str, d: Path, *worker_args: str) -> Iterator[PlannerClient]:
    """A planner process and a worker process (consumer w1, with `worker_args`) on `redis_url`,
    logging into `d`, and a client of the planner once it answers; all stopped at the end."""
    from prefixgrove.planner.client import PlannerClient

    port = free_port()
    planner = start_planner(redis_url, port, d / "planner.log")
    worker = start_worker(redis_url, d / "worker.log", "--consumer", "w1", *worker_args)
    try:
        wait_for_port(port, planner)
        client = PlannerClient(f"127.0.0.1:{port}")
        try:
            yield client
        finally:
            client.close()
    finally:
        worker.stop()
        planner.stop()


def assert_each_answered_once(client: PlannerClient, job_id: str, d: Path, total: int) -> None:
    """The finished job's files, downloaded into `d`: each custom_id answered once, and an output
    or an error line for each of its `total` requests."""
    out, err = d / "out.jsonl", d / "err.jsonl"
    client.download(job_id, out, err)
    counts = client.get(job_id).request_counts
    ids = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == counts.completed
    assert len(ids) + len(err.read_text().splitlines()) == counts.total == total
