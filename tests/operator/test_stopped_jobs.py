"""A BatchJob that ends before all its requests ran, stopped by the operator or deleted, keeps every
answered line on the volume, in input order, and names each request never run in its errors file.

The jobs hold a slow first request, so later lines are answered while the first one is not: the
files of a job still draining stop at that first line, and only following the planner job to its
end writes the lines after it."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from operator_testbed import MODEL, BatchJobs, Service
from polling import wait_for

from prefixgrove.planner.client import PlannerClient
from prefixgrove_proto import planner_pb2 as pb

RUN_TIMEOUT_S = 300.0
# the CPU worker's context limit is below the model's, which the planner checks against: a
# request this long passes the planner and is refused by the worker (context_length_exceeded)
WORKER_REFUSED_TOKENS = 3000


def request(custom_id: str, max_tokens: int) -> dict[str, Any]:
    body = {"prompt": "Count: one, two,", "max_tokens": max_tokens, "ignore_eos": True}
    return {"custom_id": custom_id, "url": "/v1/completions", "body": body}


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def expected_files(
    planner: PlannerClient, job_id: str, ids: list[str]
) -> tuple[list[str], list[tuple[str, str]]]:
    """What the files must hold once the job ended: every answer the planner has, successes in
    the output and failures in the errors file, and each request never answered as `cancelled`."""
    answers = {r.index: r for r in planner.results(job_id, 0, pb.RESULT_KIND_ALL)}
    outputs = [ids[i] for i in sorted(answers) if not answers[i].is_error]
    errors = [
        (ids[i], json.loads(answers[i].line)["error"]["code"] if i in answers else "cancelled")
        for i in range(len(ids))
        if i not in answers or answers[i].is_error
    ]
    return outputs, errors


def files(volume: Path, name: str) -> tuple[list[str], list[tuple[str, str]]]:
    outputs = [o["custom_id"] for o in records(volume / name / "out.jsonl")]
    errors = records(volume / name / "out.jsonl.errors.jsonl")
    return outputs, [(e["custom_id"], e["error"]["code"]) for e in errors]


def test_a_job_stopped_by_max_failed_ratio_keeps_every_answered_line(
    batchjobs: BatchJobs, operator: Any, cpu_worker: Service, volume: Path, planner: PlannerClient
) -> None:
    name = f"ratio-{uuid.uuid4().hex[:8]}"
    requests = [
        request("slow", 1900),
        request("fast-1", 2),
        request("too-long", WORKER_REFUSED_TOKENS),
        request("fast-2", 2),
    ]
    spec = {
        "model": MODEL,
        "input": {"inline": requests},
        "output": {"path": f"{name}/out.jsonl"},
        "maxFailedRatio": 0.1,
    }
    batchjobs.apply(name, spec)
    status = batchjobs.wait_phase(name, "Failed", "Succeeded", "Cancelled", timeout=RUN_TIMEOUT_S)
    assert status["phase"] == "Failed", status
    assert planner.get(status["jobId"]).state == pb.JOB_STATE_CANCELLED
    outputs, errors = expected_files(planner, status["jobId"], [r["custom_id"] for r in requests])
    assert outputs, "no request was answered before the stop: nothing to check"
    assert ("too-long", "context_length_exceeded") in errors
    assert files(volume, name) == (outputs, errors)
    assert not (volume / name / ".out.jsonl.written").exists()


def test_a_deleted_job_keeps_every_answered_line(
    batchjobs: BatchJobs, operator: Any, cpu_worker: Service, volume: Path, planner: PlannerClient
) -> None:
    name = f"deleted-{uuid.uuid4().hex[:8]}"
    requests = [request("slow", 1900), *(request(f"fast-{i}", 2) for i in range(1, 10))]
    spec = {"model": MODEL, "input": {"inline": requests}, "output": {"path": f"{name}/out.jsonl"}}
    batchjobs.apply(name, spec)

    def answered_but_the_first() -> dict[str, Any] | None:
        status = batchjobs.status(name)
        done = (status.get("requestCounts") or {}).get("completed", 0)
        return status if done >= 2 else None

    status = wait_for("later lines answered first", answered_but_the_first, RUN_TIMEOUT_S)
    job_id = status["jobId"]
    batchjobs.delete(name, timeout=RUN_TIMEOUT_S)
    assert planner.get(job_id).state == pb.JOB_STATE_CANCELLED
    outputs, errors = expected_files(planner, job_id, [r["custom_id"] for r in requests])
    assert ("slow", "cancelled") in errors, "the slow request ended before the delete"
    assert files(volume, name) == (outputs, errors)
