"""`prefixgrove results JOB -o OUTPUT.parquet`: with `--input` (the dataset the job was submitted
from) the rows come back with their answers joined, as `submit --wait` gives them; without it, the
result columns alone; the job's JSONL results beside it either way."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from answering_worker import answering_worker, assert_rows_with_answers
from object_store_testbed import S3Server
from services_testbed import RedisServer, planner_in_process

from prefixgrove.cli import main
from prefixgrove.settings import IngestSettings

PROMPTS = {"id": ["q0", "q1", "q2"], "text": ["Hello", None, "The sky is"]}


def submit_then_results(
    s3: S3Server, redis_server: RedisServer, capsys: pytest.CaptureFixture[str], *results: str
) -> tuple[str, int]:
    """A dataset put in a bucket and submitted (no --wait), then `results JOB` with `results`'
    flags; returns the bucket and the status of `results`."""
    bucket = s3.bucket()
    data = io.BytesIO()
    pq.write_table(pa.table(PROMPTS), data, row_group_size=2)
    s3.put(bucket, "in.parquet", data.getvalue())
    with (
        planner_in_process(redis_server.url, IngestSettings(max_model_len=512)) as (server, _),
        answering_worker(redis_server.url),
    ):
        planner = ["--planner", f"127.0.0.1:{server.port}", "--json"]
        assert main(["submit", f"s3://{bucket}/in.parquet", "--prompt-column", "text",
                     "--sampling-json", '{"max_tokens": 2}', *planner]) == 0  # fmt: skip
        job = json.loads(capsys.readouterr().out.splitlines()[0])["id"]
        flags = [f.replace("BUCKET", bucket) for f in results]
        return bucket, main(["results", job, *flags, *planner])


def test_results_into_parquet_with_the_dataset_give_its_rows_with_answers(
    s3: S3Server, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    bucket, status = submit_then_results(s3, redis_server, capsys, "-o", "s3://BUCKET/out.parquet",
                                         "--input", "s3://BUCKET/in.parquet")  # fmt: skip
    assert status == 0
    assert_rows_with_answers(s3, bucket)


def test_results_into_parquet_without_the_dataset_give_the_result_columns_alone(
    s3: S3Server, redis_server: RedisServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "answers.parquet"
    _, status = submit_then_results(s3, redis_server, capsys, "-o", str(out))
    assert status == 0
    table = pq.read_table(out)
    assert table.column_names == ["custom_id", "generated_text", "finish_reason",
                                  "prompt_tokens", "completion_tokens", "error"]  # fmt: skip
    rows = table.to_pylist()
    assert [r["custom_id"] for r in rows] == ["row-0", "row-2", "row-1"]  # answers, then errors
    assert rows[0]["generated_text"] == "answer to row-0" and rows[0]["completion_tokens"] == 2
    assert rows[2]["error"] and rows[2]["generated_text"] is None
    assert (tmp_path / "answers.parquet.jsonl").is_file()


def test_results_joined_to_another_dataset_name_it(
    s3: S3Server, redis_server: RedisServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"text": ["one", "two"]}), other)
    _, status = submit_then_results(s3, redis_server, capsys, "-o", str(tmp_path / "out.parquet"),
                                    "--input", str(other))  # fmt: skip
    assert status == 2
    assert f"{other}: the job answered more requests than its 2 rows" in capsys.readouterr().err
    assert not (tmp_path / "out.parquet").exists()
