"""Failed requests show on the BatchJob: a RequestsFailed condition naming the first one by its
request line, a Warning Event, and spec.maxFailedRatio turning too many of them into Failed."""

from __future__ import annotations

import json
import uuid
from typing import Any

from k8s_fixtures import KubeApi
from operator_testbed import MODEL, NAMESPACE, BatchJobs, Service

RUN_TIMEOUT_S = 180.0


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    (found,) = [c for c in status.get("conditions", []) if c["type"] == kind]
    return found


def finished_job_with_a_broken_line(
    crd: KubeApi, batchjobs: BatchJobs, **spec: Any
) -> tuple[str, dict[str, Any]]:
    """A BatchJob of three request lines from a ConfigMap, the second of them not JSON, run to
    its end: its name and its final status."""
    name = f"broken-{uuid.uuid4().hex[:8]}"
    good = {"url": "/v1/completions", "body": {"prompt": "Hello", "max_tokens": 2}}
    text = "\n".join(
        [
            json.dumps({"custom_id": "a", **good}),
            '{"custom_id": "b", oops',
            json.dumps({"custom_id": "c", **good}),
        ]
    )
    crd.kubectl("create", "configmap", name, "-n", NAMESPACE, f"--from-literal=in.jsonl={text}")
    batchjobs.apply(
        name,
        {
            "model": MODEL,
            "input": {"configMap": {"name": name, "key": "in.jsonl"}},
            "output": {"path": f"{name}.jsonl"},
            **spec,
        },
    )
    return name, batchjobs.wait_phase(name, "Succeeded", "Failed", timeout=RUN_TIMEOUT_S)


def test_a_failed_request_gets_a_condition_naming_its_line_and_a_warning(
    batchjobs: BatchJobs, operator: Any, cpu_worker: Service, crd: KubeApi
) -> None:
    name, status = finished_job_with_a_broken_line(crd, batchjobs)
    assert status["phase"] == "Succeeded", status
    assert status["requestCounts"] == {"total": 3, "completed": 2, "failed": 1}
    failed = condition(status, "RequestsFailed")
    assert failed["status"] == "True"
    assert failed["message"].startswith("1 of 3 requests failed"), failed
    assert "request line 2" in failed["message"] and "invalid_json" in failed["message"], failed
    assert "1 of 3 requests failed" in batchjobs.warnings(name)["RequestsFailed"]


def test_the_requests_failed_warning_names_the_first_failed_line(
    batchjobs: BatchJobs, operator: Any, cpu_worker: Service
) -> None:
    name = f"named-{uuid.uuid4().hex[:8]}"
    requests = [
        {"custom_id": cid, "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": n}}
        for cid, n in (("a", 2), ("b", 0), ("c", 2))
    ]
    spec = {"model": MODEL, "input": {"inline": requests}, "output": {"path": f"{name}.jsonl"}}
    batchjobs.apply(name, spec)
    status = batchjobs.wait_phase(name, "Succeeded", "Failed", timeout=RUN_TIMEOUT_S)
    assert status["phase"] == "Succeeded", status
    warning = batchjobs.warnings(name)["RequestsFailed"]
    assert "request line 2 (custom_id 'b'): invalid_value: " in warning, warning
    assert warning == condition(status, "RequestsFailed")["message"]


def test_a_job_without_failures_has_no_requests_failed_condition(
    batchjobs: BatchJobs, operator: Any, cpu_worker: Service
) -> None:
    name = f"clean-{uuid.uuid4().hex[:8]}"
    request = {
        "custom_id": "a",
        "url": "/v1/completions",
        "body": {"prompt": "Hi", "max_tokens": 1},
    }
    batchjobs.apply(
        name, {"model": MODEL, "input": {"inline": [request]}, "output": {"path": f"{name}.jsonl"}}
    )
    status = batchjobs.wait_phase(name, "Succeeded", "Failed", timeout=RUN_TIMEOUT_S)
    assert status["phase"] == "Succeeded", status
    assert "RequestsFailed" not in {c["type"] for c in status["conditions"]}
    assert "RequestsFailed" not in batchjobs.warnings(name)


def test_more_failures_than_max_failed_ratio_fail_the_job(
    batchjobs: BatchJobs, operator: Any, cpu_worker: Service, crd: KubeApi
) -> None:
    name, status = finished_job_with_a_broken_line(crd, batchjobs, maxFailedRatio=0.25)
    assert status["phase"] == "Failed", status
    failed = condition(status, "Failed")
    assert failed["reason"] == "TooManyFailedRequests"
    assert "more than spec.maxFailedRatio 0.25" in failed["message"]
    assert "Failed" in batchjobs.warnings(name)


def test_failures_within_max_failed_ratio_still_succeed(
    batchjobs: BatchJobs, operator: Any, cpu_worker: Service, crd: KubeApi
) -> None:
    _, status = finished_job_with_a_broken_line(crd, batchjobs, maxFailedRatio=0.5)
    assert status["phase"] == "Succeeded", status
    assert condition(status, "RequestsFailed")["status"] == "True"
