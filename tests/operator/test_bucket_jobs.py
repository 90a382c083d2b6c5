"""BatchJobs whose input and output live in a bucket (moto's S3-compatible server): the planner
reads `spec.input.url` with the credentials of `spec.credentialsSecret`, the operator writes the
results to `spec.output.url` with them, and no value of the Secret ever shows in status, Events
or logs."""

from __future__ import annotations

import io
import json
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from k8s_fixtures import KubeApi
from object_store_testbed import REGION, S3Server, s3_server
from operator_testbed import MODEL, NAMESPACE, BatchJobs, Service
from polling import wait_for
from test_lifecycle import RUN_TIMEOUT_S, completion

__all__ = ["s3_server"]  # the module's S3 server (a fixture)


def credentials_secret(
    kube: KubeApi, s3: S3Server, secret_key: str | None = None, name: str = ""
) -> str:
    """A Secret holding the bucket's credentials, as a platform team makes one."""
    name = name or f"bucket-{uuid.uuid4().hex[:8]}"
    values = {"AWS_ACCESS_KEY_ID": s3.access_key,
              "AWS_SECRET_ACCESS_KEY": secret_key or s3.secret_key,
              "AWS_REGION": REGION, "AWS_ENDPOINT_URL": s3.endpoint}  # fmt: skip
    literals = [f"--from-literal={key}={value}" for key, value in values.items()]
    kube.kubectl("create", "secret", "generic", name, "-n", NAMESPACE, *literals)
    return name


@pytest.fixture
def everything_shown(
    crd: KubeApi, batchjobs: BatchJobs, logs_dir: Path, caplog: pytest.LogCaptureFixture
) -> Callable[[str], str]:
    """What people and tools can read of a BatchJob, by its name: its status, its Events, the
    operator's log records (it runs in this process, at DEBUG) and the planners' log files."""
    caplog.set_level(logging.DEBUG)

    def shown(name: str) -> str:
        events = crd.kubectl("get", "events", "-n", NAMESPACE, "-o", "json",
                             f"--field-selector=involvedObject.name={name}")  # fmt: skip
        files = "".join(p.read_text(errors="replace") for p in logs_dir.glob("planner-*.log"))
        return json.dumps(batchjobs.status(name)) + events + caplog.text + files

    return shown


def test_a_batchjob_reads_a_bucket_and_writes_its_results_into_it_with_a_secrets_keys(
    batchjobs: BatchJobs, operator: Any, cpu_worker: Service, crd: KubeApi,
    s3_server: S3Server, everything_shown: Callable[[str], str],
) -> None:  # fmt: skip
    bucket, name = s3_server.bucket(), f"s3-{uuid.uuid4().hex[:8]}"
    requests = [completion("a", "The capital of France is"),
                completion("b", "No tokens", max_tokens=0), completion("c", "One, two,")]  # fmt: skip
    s3_server.put(
        bucket, "in/requests.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in requests)
    )
    secret = credentials_secret(crd, s3_server)
    batchjobs.apply(name, {
        "model": MODEL, "credentialsSecret": secret,
        "input": {"url": f"s3://{bucket}/in/requests.jsonl"},
        "output": {"url": f"s3://{bucket}/out/answers.jsonl"},
    })  # fmt: skip
    status = batchjobs.wait_phase(name, "Succeeded", "Failed", timeout=RUN_TIMEOUT_S)
    assert status["phase"] == "Succeeded", status
    assert status["requestCounts"] == {"total": 3, "completed": 2, "failed": 1}
    outputs = s3_server.get(bucket, "out/answers.jsonl").decode().splitlines()
    errors = s3_server.get(bucket, "out/answers.errors.jsonl").decode().splitlines()
    assert [json.loads(o)["custom_id"] for o in outputs] == ["a", "c"]
    assert [json.loads(e)["custom_id"] for e in errors] == ["b"]
    # committed whole: no parts and no marker are left beside the objects
    assert s3_server.keys(bucket) == ["in/requests.jsonl", "out/answers.errors.jsonl",
                                      "out/answers.jsonl"]  # fmt: skip
    shown = everything_shown(name)
    assert f"s3://{bucket}/out/answers.jsonl" in shown
    assert s3_server.secret_key not in shown


def test_a_parquet_batchjob_is_read_a_request_per_row(
    batchjobs: BatchJobs, operator: Any, cpu_worker: Service, crd: KubeApi, s3_server: S3Server
) -> None:
    bucket, name = s3_server.bucket(), f"pq-{uuid.uuid4().hex[:8]}"
    table = pa.table({"text": ["Hello", "One, two,", "The sky is"], "topic": ["x", "y", "z"]})
    data = io.BytesIO()
    pq.write_table(table, data, row_group_size=2)
    s3_server.put(bucket, "rows.parquet", data.getvalue())
    batchjobs.apply(name, {
        "model": MODEL, "credentialsSecret": credentials_secret(crd, s3_server),
        "input": {"url": f"s3://{bucket}/rows.parquet", "format": "parquet",
                  "promptColumn": "text"},
        "output": {"url": f"s3://{bucket}/rows.jsonl"}, "sampling": {"maxTokens": 2},
    })  # fmt: skip
    status = batchjobs.wait_phase(name, "Succeeded", "Failed", timeout=RUN_TIMEOUT_S)
    assert status["phase"] == "Succeeded", status
    outputs = [json.loads(line) for line in s3_server.get(bucket, "rows.jsonl").splitlines()]
    assert [o["custom_id"] for o in outputs] == ["row-0", "row-1", "row-2"]
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 2 for o in outputs)


def test_a_wrong_secret_fails_the_batchjob_naming_the_url_and_showing_no_secret(
    batchjobs: BatchJobs, operator: Any, crd: KubeApi, s3_server: S3Server,
    everything_shown: Callable[[str], str],
) -> None:  # fmt: skip
    bucket, name = s3_server.bucket(), f"bad-{uuid.uuid4().hex[:8]}"
    s3_server.put(bucket, "in.jsonl", json.dumps(completion("a", "Hi")).encode() + b"\n")
    wrong = f"wrong-{uuid.uuid4().hex}"
    batchjobs.apply(name, {
        "model": MODEL, "credentialsSecret": credentials_secret(crd, s3_server, secret_key=wrong),
        "input": {"url": f"s3://{bucket}/in.jsonl"}, "output": {"path": f"{name}/out.jsonl"},
    })  # fmt: skip
    status = batchjobs.wait_phase(name, "Succeeded", "Failed", timeout=RUN_TIMEOUT_S)
    assert status["phase"] == "Failed", status
    assert f"s3://{bucket}/in.jsonl" in status["message"]
    assert "input_unreadable" in status["message"] and "wrong credentials" in status["message"]
    shown = everything_shown(name)
    assert wrong not in shown and s3_server.secret_key not in shown


def test_a_missing_secret_fails_the_batchjob_naming_it(batchjobs: BatchJobs, operator: Any) -> None:
    name = f"nosecret-{uuid.uuid4().hex[:8]}"
    batchjobs.apply(name, {
        "model": MODEL, "credentialsSecret": "no-such-secret",
        "input": {"url": "s3://some-bucket/in.jsonl"}, "output": {"url": "s3://some-bucket/o.jsonl"},
    })  # fmt: skip
    status = batchjobs.wait_phase(name, "Failed", timeout=30)
    assert "no Secret 'no-such-secret'" in status["message"]


def test_outputs_refused_wait_in_finalizing_and_are_written_once_the_secret_is_fixed(
    batchjobs: BatchJobs, operator: Any, cpu_worker: Service, crd: KubeApi,
    s3_server: S3Server, everything_shown: Callable[[str], str],
) -> None:  # fmt: skip
    bucket, name = s3_server.bucket(), f"fix-{uuid.uuid4().hex[:8]}"
    wrong = f"wrong-{uuid.uuid4().hex}"
    secret = credentials_secret(crd, s3_server, secret_key=wrong)
    url = f"s3://{bucket}/answers.jsonl"
    batchjobs.apply(name, {
        "model": MODEL, "credentialsSecret": secret,
        "input": {"inline": [completion("a", "The capital of France is")]}, "output": {"url": url},
    })  # fmt: skip
    warning = wait_for("an OutputNotWritten Warning", lambda: batchjobs.warnings(name).get(
        "OutputNotWritten"), RUN_TIMEOUT_S)  # fmt: skip
    assert url in warning and "wrong credentials" in warning
    batchjobs.wait_phase(name, "Finalizing", timeout=RUN_TIMEOUT_S)  # answered, not written
    crd.kubectl("delete", "secret", secret, "-n", NAMESPACE)
    credentials_secret(crd, s3_server, name=secret)  # the right key, under the same name
    status = batchjobs.wait_phase(name, "Succeeded", "Failed", timeout=RUN_TIMEOUT_S)
    assert status["phase"] == "Succeeded", status
    outputs = s3_server.get(bucket, "answers.jsonl").decode().splitlines()
    assert [json.loads(o)["custom_id"] for o in outputs] == ["a"]
    shown = everything_shown(name)
    assert wrong not in shown and s3_server.secret_key not in shown
