"""The OpenAI Batch API's files kept in a bucket (`--files-url`): two planner replicas over one
Redis and one bucket see the same files, so a file uploaded through one is listed, read, run as a
batch's input and deleted through the other; an upload is committed whole (several parts here)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from http_uploads import MultipartUpload, call
from object_store_testbed import S3Server
from polling import wait_for
from services_testbed import RedisServer, free_port, planner_in_process
from test_download import job_lines

from prefixgrove.settings import IngestSettings


@pytest.fixture
def two_replicas(
    s3: S3Server, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, int, int]]:
    """(bucket, HTTP port of replica A, of replica B), both keeping files under s3://B/files."""
    monkeypatch.setenv("PREFIXGROVE_OBJECT_PART_BYTES", "1024")  # an upload of several parts
    bucket = s3.bucket()
    ports = free_port(), free_port()
    with ExitStack() as stack:
        for port in ports:
            stack.enter_context(planner_in_process(
                redis_server.url, IngestSettings(max_model_len=512), http_port=port,
                files_url=f"s3://{bucket}/files",
            ))  # fmt: skip
        yield bucket, *ports


def content(port: int, file_id: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/files/{file_id}/content") as f:
        return bytes(f.read())


def test_a_file_uploaded_through_one_replica_is_served_by_the_other(
    two_replicas: tuple[str, int, int], s3: S3Server, tmp_path: Path
) -> None:
    bucket, a, b = two_replicas
    data = b"".join(line + b"\n" for line in job_lines())
    (tmp_path / "in.jsonl").write_bytes(data)
    uploaded = MultipartUpload(tmp_path / "in.jsonl").send(a)
    assert uploaded.status == 200, uploaded
    file_id = uploaded.body["id"]
    assert uploaded.body["bytes"] == len(data) > 1024
    listed = call(b, "GET", "/v1/files").body["data"]
    assert [f["id"] for f in listed] == [file_id]
    assert content(b, file_id) == data
    assert s3.keys(bucket) == [f"files/{file_id}", f"files/{file_id}.json"]  # no parts left


def test_a_batch_created_on_the_other_replica_reads_the_file_from_the_bucket(
    two_replicas: tuple[str, int, int], tmp_path: Path
) -> None:
    _, a, b = two_replicas
    (tmp_path / "in.jsonl").write_bytes(b"".join(line + b"\n" for line in job_lines()))
    file_id = MultipartUpload(tmp_path / "in.jsonl").send(a).body["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    batch = call(b, "POST", "/v1/batches", json_body(body), {"Content-Type": "application/json"})
    assert batch.status == 200, batch
    done = wait_for("the batch to leave validating", lambda: (
        (found := call(a, "GET", f"/v1/batches/{batch.body['id']}").body)["status"] != "validating"
        and found), 30)  # fmt: skip
    assert done["status"] == "in_progress", done
    assert done["request_counts"]["total"] == len(job_lines())


def test_a_file_deleted_through_one_replica_is_gone_from_the_other(
    two_replicas: tuple[str, int, int], s3: S3Server, tmp_path: Path
) -> None:
    bucket, a, b = two_replicas
    (tmp_path / "in.jsonl").write_bytes(job_lines()[0] + b"\n")
    file_id = MultipartUpload(tmp_path / "in.jsonl").send(a).body["id"]
    assert call(b, "DELETE", f"/v1/files/{file_id}").body["deleted"] is True
    assert call(a, "GET", f"/v1/files/{file_id}").status == 404
    assert call(a, "GET", "/v1/files").body["data"] == []
    assert s3.keys(bucket) == []


def json_body(body: dict[str, str]) -> bytes:
    import json

    return json.dumps(body).encode()


def test_a_planner_starting_deletes_the_parts_of_uploads_left_long_ago(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datetime import timedelta

    from prefixgrove.planner.http import object_files

    bucket = s3.bucket()
    left = object_files.ObjectFileStore(f"s3://{bucket}/files", part_bytes=1024)
    upload = left.create()
    for _ in range(2):  # two parts uploaded, never finished: a planner stopped
        upload.handle.write(b"x" * 1100)
    assert len(s3.keys(bucket)) == 2
    object_files.ObjectFileStore(f"s3://{bucket}/files", part_bytes=1024)  # parts are fresh
    assert len(s3.keys(bucket)) == 2
    monkeypatch.setattr(object_files, "STALE_PARTS", timedelta(0))
    object_files.ObjectFileStore(f"s3://{bucket}/files", part_bytes=1024)
    assert s3.keys(bucket) == []
