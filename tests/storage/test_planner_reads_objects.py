"""A job created with a `source` is read by the planner itself from the bucket, with the job's own
credentials when it brings them, and sealed; an object it cannot read fails the job naming the
URL and why, and never shows a credential."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from object_store_testbed import REGION, S3Server
from polling import wait_for
from services_testbed import RedisServer, planner_in_process
from test_download import job_lines

from prefixgrove.planner.client import PlannerClient
from prefixgrove.settings import IngestSettings
from prefixgrove_proto import planner_pb2 as pb

INGEST = IngestSettings(max_model_len=512)


def final(client: PlannerClient, job_id: str) -> pb.Job:
    return wait_for(
        f"job {job_id} to leave VALIDATING",
        lambda: (job := client.get(job_id)).state != pb.JOB_STATE_VALIDATING and job,
        30,
    )


def credentials(s3: S3Server, secret: str | None = None) -> dict[str, str]:
    """What a BatchJob's Secret holds: the job's own key, region and endpoint."""
    return {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": secret or s3.secret_key,
            "AWS_REGION": REGION, "AWS_ENDPOINT_URL": s3.endpoint}  # fmt: skip


def test_the_planner_reads_a_jsonl_object_with_the_jobs_credentials(
    s3: S3Server, redis_server: RedisServer
) -> None:
    bucket = s3.bucket()
    s3.put(bucket, "in.jsonl", b"".join(line + b"\n" for line in job_lines()))
    source = pb.InputSource(url=f"s3://{bucket}/in.jsonl", credentials=credentials(s3),
                            body_defaults_json=json.dumps({"max_tokens": 2}))  # fmt: skip
    with planner_in_process(redis_server.url, INGEST) as (_, client):
        job = final(client, client.create_job(source=source).id)
    assert job.state == pb.JOB_STATE_IN_PROGRESS, job.error
    invalid = sum(1 for line in job_lines() if line.startswith(b"{not"))
    assert job.request_counts.total == len(job_lines())
    assert job.request_counts.failed == invalid


def test_the_planner_reads_a_parquet_object_a_request_per_row(
    s3: S3Server, redis_server: RedisServer, tmp_path: Path
) -> None:
    bucket = s3.bucket()
    local = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": [f"item {i}" for i in range(5)]}), local, row_group_size=2)
    s3.put(bucket, "in.parquet", local.read_bytes())
    source = pb.InputSource(url=f"s3://{bucket}/in.parquet", format="parquet",
                            prompt_column="text", credentials=credentials(s3))  # fmt: skip
    with planner_in_process(redis_server.url, INGEST) as (_, client):
        job = final(client, client.create_job(source=source).id)
        assert job.state == pb.JOB_STATE_IN_PROGRESS, job.error
        assert job.request_counts.total == 5 and job.request_counts.failed == 0


def test_an_object_read_with_a_wrong_secret_fails_its_job_naming_the_url_never_the_secret(
    s3: S3Server, redis_server: RedisServer
) -> None:
    bucket = s3.bucket()
    s3.put(bucket, "in.jsonl", job_lines()[0] + b"\n")
    wrong = "wrong-secret-0123456789abcdef"
    url = f"s3://{bucket}/in.jsonl"
    source = pb.InputSource(url=url, credentials=credentials(s3, secret=wrong))
    with planner_in_process(redis_server.url, INGEST) as (_, client):
        job = final(client, client.create_job(source=source).id)
    assert job.state == pb.JOB_STATE_FAILED
    assert job.error.code == "input_unreadable"
    assert url in job.error.message and "wrong credentials" in job.error.message
    assert wrong not in str(job) and s3.access_key not in job.error.message


def test_a_missing_bucket_fails_its_job_as_no_such_bucket(
    s3: S3Server, redis_server: RedisServer
) -> None:
    source = pb.InputSource(url="s3://no-such-bucket-pg/in.jsonl", credentials=credentials(s3))
    with planner_in_process(redis_server.url, INGEST) as (_, client):
        job = final(client, client.create_job(source=source).id)
    assert job.error.code == "input_unreadable"
    assert "s3://no-such-bucket-pg/in.jsonl" in job.error.message
    assert "no such bucket" in job.error.message
