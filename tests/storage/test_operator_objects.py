"""The operator's writer of a BatchJob's results into a bucket (object_results.py): each round
uploads its lines as parts and a marker; nothing shows under the outputs' names before the last
round commits them; a round that stopped after its parts and before its marker is undone by the
next, so every line is written once, the same bytes as the writer of files on the volume."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from object_store_testbed import REGION, S3Server
from services_testbed import RedisServer, planner_in_process
from test_download import answer_every_request, job_lines

from prefixgrove.planner.client import PlannerClient
from prefixgrove.settings import IngestSettings
from prefixgrove_operator.object_results import MARKER_SUFFIX, append_new_objects
from prefixgrove_operator.results import append_new_results


@pytest.fixture
def answered_job(redis_server: RedisServer) -> Iterator[tuple[PlannerClient, str]]:
    """A planner's client and a job it holds every answer of."""
    with planner_in_process(redis_server.url, IngestSettings(max_model_len=512)) as (_, client):
        job = client.submit_lines(job_lines)
        answer_every_request(redis_server.url, job.id)
        yield client, job.id


def secret(s3: S3Server) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key,
            "AWS_REGION": REGION, "AWS_ENDPOINT_URL": s3.endpoint}  # fmt: skip


def _first_round(
    answered_job: tuple[PlannerClient, str], s3: S3Server, prefix: str
) -> tuple[str, str, str]:
    """A new bucket, and a round of the job's results written into it under `prefix`, not
    committed: (the bucket, the outputs' URL, the errors' URL)."""
    client, job_id = answered_job
    bucket = s3.bucket()
    out, err = f"s3://{bucket}/{prefix}out.jsonl", f"s3://{bucket}/{prefix}out.errors.jsonl"
    append_new_objects(client, job_id, out, err, False, secret(s3))
    return bucket, out, err


def _assert_objects_hold_the_files_bytes(
    answered_job: tuple[PlannerClient, str], s3: S3Server, bucket: str, prefix: str, tmp_path: Path
) -> None:
    """The committed objects hold the bytes that the writer of files writes for the same job."""
    client, job_id = answered_job
    files = tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
    append_new_results(client, job_id, *files, True)
    assert s3.get(bucket, f"{prefix}out.jsonl") == files[0].read_bytes()
    assert s3.get(bucket, f"{prefix}out.errors.jsonl") == files[1].read_bytes()


def test_rounds_upload_parts_and_the_last_commits_the_same_bytes_as_files(
    answered_job: tuple[PlannerClient, str], s3: S3Server, tmp_path: Path
) -> None:
    client, job_id = answered_job
    bucket, out, err = _first_round(answered_job, s3, "o/")
    assert "o/out.jsonl" not in s3.keys(bucket)  # parts and a marker only, until the commit
    assert f"o/out.jsonl{MARKER_SUFFIX}" in s3.keys(bucket)
    written, _ = append_new_objects(client, job_id, out, err, True, secret(s3))
    _assert_objects_hold_the_files_bytes(answered_job, s3, bucket, "o/", tmp_path)
    assert written.outputs + written.errors == len(job_lines())
    assert s3.keys(bucket) == ["o/out.errors.jsonl", "o/out.jsonl"]


def test_parts_a_stopped_round_left_past_its_marker_are_dropped(
    answered_job: tuple[PlannerClient, str], s3: S3Server, tmp_path: Path
) -> None:
    client, job_id = answered_job
    bucket, out, err = _first_round(answered_job, s3, "")
    for name in ("out.jsonl", "out.errors.jsonl"):  # a round's parts, its marker never written
        s3.put(bucket, f"{name}.prefixgrove-parts/part-000002", b'{"written": "twice"}\n')
    append_new_objects(client, job_id, out, err, True, secret(s3))
    _assert_objects_hold_the_files_bytes(answered_job, s3, bucket, "", tmp_path)
