"""A worker without a model, on a thread: answers every request of every job the planner holds,
each answer's text naming its request."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow.parquet as pq
import redis
from object_store_testbed import S3Server
from services_testbed import MODEL

from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.queue import GroupQueue
from prefixgrove.jobs.redis_store.schema import ResultRecord
from prefixgrove.jobs.redis_store.store import JobStore


def completion(custom_id: str, prompt_tokens: int) -> str:
    """An answer shaped as a worker writes one: the text names the request."""
    body = {"choices": [{"index": 0, "text": f"answer to {custom_id}", "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 2}}  # fmt: skip
    return json.dumps({"custom_id": custom_id, "response": {"status_code": 200, "body": body}})


@contextmanager
def answering_worker(redis_url: str) -> Iterator[None]:
    """A worker without a model, on a thread: every request of every job answered."""
    store, stop = JobStore(connect(redis_url)), threading.Event()
    queue = GroupQueue(store.r, MODEL, "w1", lease_timeout_s=60)

    def work() -> None:
        while not stop.is_set():
            try:
                leases = queue.take(8, block_ms=100)
            except redis.ResponseError:  # no job sealed yet: the queue is made by the first seal
                time.sleep(0.05)
                continue
            for lease in leases:
                loaded = store.load_group(lease.job_id, lease.group_id)
                assert loaded is not None
                group, records = loaded
                store.mark_leased(lease.job_id, lease.group_id)
                store.write_results(lease.job_id, [
                    (i, ResultRecord(False, completion(r.custom_id, len(r.prompt_token_ids))), 1)
                    for i, r in zip(group.indices, records, strict=True)
                ])  # fmt: skip
                store.finish_group(lease.job_id, lease.group_id)
                queue.ack(lease)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def assert_rows_with_answers(s3: S3Server, bucket: str) -> None:
    """out.parquet in the bucket is the three-row dataset (ids q0..q2, row 1 failing) with its
    answers joined, the job's JSONL results beside it."""
    rows = pq.read_table(io.BytesIO(s3.get(bucket, "out.parquet"))).to_pylist()
    assert [r["id"] for r in rows] == ["q0", "q1", "q2"]
    assert [r["generated_text"] for r in rows] == ["answer to row-0", None, "answer to row-2"]
    assert rows[1]["error"] and rows[0]["error"] is None
    assert {"out.parquet.jsonl", "out.parquet.errors.jsonl"} <= set(s3.keys(bucket))
