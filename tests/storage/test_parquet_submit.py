"""`prefixgrove submit` takes a Parquet dataset (from a file or a bucket) as `run` does: a request
per row; with `--wait -o OUTPUT.parquet` the answers come back joined to the rows, row for row."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
from answering_worker import answering_worker, assert_rows_with_answers
from object_store_testbed import S3Server
from services_testbed import RedisServer, planner_in_process

from prefixgrove.cli import main
from prefixgrove.settings import IngestSettings


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
    assert_rows_with_answers(s3, bucket)
