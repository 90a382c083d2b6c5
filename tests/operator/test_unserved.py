"""A BatchJob no worker serves says so: Queued, then the Unserved condition and a Warning Event,
then Failed after spec.queueTimeoutSeconds. No worker runs in this module."""

from __future__ import annotations

import uuid
from typing import Any

from operator_testbed import MODEL, BatchJobs
from polling import wait_for

from prefixgrove.planner.client import PlannerClient
from prefixgrove_proto import planner_pb2 as pb

QUEUE_TIMEOUT_S = 6


def test_a_job_no_worker_takes_is_queued_then_warned_then_failed(
    batchjobs: BatchJobs, operator: Any, planner: PlannerClient
) -> None:
    name = f"unserved-{uuid.uuid4().hex[:8]}"
    request = {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "Hi"}}
    spec = {
        "model": MODEL,
        "input": {"inline": [request]},
        "output": {"path": f"{name}.jsonl"},
        "queueTimeoutSeconds": QUEUE_TIMEOUT_S,
    }
    batchjobs.apply(name, spec)
    batchjobs.wait_phase(name, "Queued")
    warned = wait_for(
        "the Unserved condition while Queued",
        lambda: (
            (s := batchjobs.status(name)).get("phase") == "Queued"
            and any(c["type"] == "Unserved" and c["status"] == "True" for c in s["conditions"])
        ),
    )
    assert warned
    assert f"model {MODEL!r}" in batchjobs.warnings(name)["Unserved"]
    status = batchjobs.wait_phase(name, "Failed", timeout=4 * QUEUE_TIMEOUT_S)
    (failed,) = [c for c in status["conditions"] if c["type"] == "Failed"]
    assert failed["reason"] == "Unserved"
    assert "spec.queueTimeoutSeconds" in batchjobs.warnings(name)["Failed"]
    job_id = batchjobs.status(name)["jobId"]
    assert planner.get(job_id).state in (pb.JOB_STATE_CANCELLING, pb.JOB_STATE_CANCELLED)
