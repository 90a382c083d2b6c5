"""`prefixgrove submit` takes a Parquet dataset (from a file or a bucket) as `run` does: a request
per row; with `--wait -o OUTPUT.parquet` the answers come back joined to the rows, row for row."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.parquet as pq
import redis
from object_store_testbed import S3Server
from services_testbed import MODEL, RedisServer, planner_in_process

from prefixgrove.cli import main
from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.queue import GroupQueue
from prefixgrove.jobs.redis_store.schema import ResultRecord
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.settings import IngestSettings


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


def test_a_parquet_dataset_submitted_from_a_bucket_comes_back_as_its_rows_with_answers(
    s3: S3Server, redis_server: RedisServer
) -> None:
    bucket = s3.bucket()
    table = pa.table({"id": ["q0", "q1", "q2"], "text": ["Hello", None, "The sky is"]})
    data = io.BytesIO()
    pq.write_table(table, data, row_group_size=2)
    s3.put(bucket, "in.parquet", data.getvalue())
    ingest = IngestSettings(max_model_len=512)
    with (
        planner_in_process(redis_server.url, ingest) as (server, _),
        answering_worker(redis_server.url),
    ):
        status = main(["submit", f"s3://{bucket}/in.parquet", "--prompt-column", "text",
                       "--id-column", "id", "--sampling-json", '{"max_tokens": 2}', "--wait",
                       "-o", f"s3://{bucket}/out.parquet", "--planner",
                       f"127.0.0.1:{server.port}", "--json"])  # fmt: skip
    assert status == 0
    rows = pq.read_table(io.BytesIO(s3.get(bucket, "out.parquet"))).to_pylist()
    assert [r["id"] for r in rows] == ["q0", "q1", "q2"]
    assert [r["generated_text"] for r in rows] == ["answer to row-0", None, "answer to row-2"]
    assert rows[1]["error"] and rows[0]["error"] is None
    assert {"out.parquet.jsonl", "out.parquet.errors.jsonl"} <= set(s3.keys(bucket))
