"""`prefixgrove submit` reads its input from a bucket, and `results` writes a job's files into
one, committed whole: the same bytes as a download to local files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from object_store_testbed import S3Server
from services_testbed import RedisServer, planner_in_process
from test_download import answer_every_request, job_lines

from prefixgrove.cli import main
from prefixgrove.settings import IngestSettings


def test_submit_from_a_bucket_and_results_into_one(
    s3: S3Server, redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bucket = s3.bucket()
    s3.put(bucket, "jobs/in.jsonl", b"".join(line + b"\n" for line in job_lines()))
    with planner_in_process(redis_server.url, IngestSettings(max_model_len=512)) as (server, c):
        planner = ["--planner", f"127.0.0.1:{server.port}", "--json"]
        assert main(["submit", f"s3://{bucket}/jobs/in.jsonl", *planner]) == 0
        job_id = json.loads(capsys.readouterr().out.splitlines()[-1])["id"]
        answer_every_request(redis_server.url, job_id)
        local = tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
        c.download(job_id, *local)
        assert main(["results", job_id, "-o", f"s3://{bucket}/results/out.jsonl", *planner]) == 0
    assert s3.get(bucket, "results/out.jsonl") == local[0].read_bytes()
    assert s3.get(bucket, "results/out.errors.jsonl") == local[1].read_bytes()
    assert local[0].read_bytes().count(b"\n") > 0 and local[1].read_bytes().count(b"\n") > 0
    assert s3.keys(bucket) == ["jobs/in.jsonl", "results/out.errors.jsonl", "results/out.jsonl"]
