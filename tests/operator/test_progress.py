"""A BatchJob tells the truth while it runs: its phases in order, its counts and its output file
growing request by request, and `spec.cancel` ending it with the answers it got."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from operator_testbed import MODEL, BatchJobs, PhaseWatch, Service
from polling import wait_for

from prefixgrove.planner.client import PlannerClient
from prefixgrove_proto import planner_pb2 as pb

RUN_TIMEOUT_S = 300.0
# the order a BatchJob's phases come in; a short job may skip Queued
PHASE_ORDER = ["Pending", "Validating", "Queued", "Running", "Succeeded"]


def slow_requests(count: int, step: int) -> list[dict[str, Any]]:
    """One prefix group whose requests end one after another: request i makes (i + 1) * step
    tokens, so the earlier lines of the input are answered first."""
    return [
        {
            "custom_id": f"r{i}",
            "url": "/v1/completions",
            "body": {
                "prompt": "Count slowly and never stop: one, two, three,",
                "max_tokens": (i + 1) * step,
                "ignore_eos": True,
                "temperature": 0,
            },
        }
        for i in range(count)
    ]


def slow_job(count: int, step: int, output: str) -> dict[str, Any]:
    """A BatchJob spec of `slow_requests(count, step)`, its output at `output` on the volume."""
    return {
        "model": MODEL,
        "input": {"inline": slow_requests(count, step)},
        "output": {"path": output},
    }


def output_ids(path: Path) -> list[str]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(line)["custom_id"] for line in text.splitlines()]


def test_a_job_shows_pending_validating_running_then_succeeded_to_a_watch(
    batchjobs: BatchJobs, operator: Any, cpu_worker: Service, logs_dir: Path
) -> None:
    name = f"phases-{uuid.uuid4().hex[:8]}"
    # long enough to be seen Running by a status round (every 0.5 s here)
    spec = slow_job(2, step=200, output=f"{name}.jsonl")
    with PhaseWatch(batchjobs.kube, name, logs_dir) as watch:
        wait_for("the watch to start", lambda: watch.proc.poll() is None and watch.out.exists())
        batchjobs.apply(name, spec)
        batchjobs.wait_phase(name, "Succeeded", "Failed", timeout=RUN_TIMEOUT_S)
        phases = wait_for(
            "the watch to see the end", lambda: "Succeeded" in (p := watch.phases()) and p
        )
    assert phases[:2] == ["Pending", "Validating"], phases
    assert "Running" in phases, phases
    assert phases[-1] == "Succeeded", phases
    assert phases == sorted(phases, key=PHASE_ORDER.index), phases


def test_counts_and_the_output_file_grow_request_by_request(
    batchjobs: BatchJobs, operator: Any, cpu_worker: Service, volume: Path
) -> None:
    name = f"progress-{uuid.uuid4().hex[:8]}"
    total = 4
    batchjobs.apply(name, slow_job(total, step=100, output=f"{name}.jsonl"))

    def part_way() -> dict[str, Any] | None:
        status = batchjobs.status(name)
        done = (status.get("requestCounts") or {}).get("completed", 0)
        return status if status.get("phase") == "Running" and 0 < done < total else None

    status = wait_for("some but not all requests answered", part_way, timeout=RUN_TIMEOUT_S)
    assert status["progress"] == f"{100 * status['requestCounts']['completed'] // total}%"
    early = wait_for(
        "answers in the output file before the job ends",
        lambda: (
            batchjobs.status(name).get("phase") == "Running"
            and output_ids(volume / f"{name}.jsonl")
        ),
        timeout=RUN_TIMEOUT_S,
    )
    assert early == [f"r{i}" for i in range(len(early))]  # input order, no gaps
    final = batchjobs.wait_phase(name, "Succeeded", "Failed", timeout=RUN_TIMEOUT_S)
    assert final["requestCounts"] == {"total": total, "completed": total, "failed": 0}
    assert output_ids(volume / f"{name}.jsonl") == [f"r{i}" for i in range(total)]


def test_spec_cancel_ends_cancelled_with_the_answers_it_got(
    batchjobs: BatchJobs, operator: Any, cpu_worker: Service, volume: Path, planner: PlannerClient
) -> None:
    name = f"cancel-{uuid.uuid4().hex[:8]}"
    total = 4
    batchjobs.apply(name, slow_job(total, step=200, output=f"{name}/out.jsonl"))
    wait_for(
        "the first answer",
        lambda: (batchjobs.status(name).get("requestCounts") or {}).get("completed", 0) >= 1,
        timeout=RUN_TIMEOUT_S,
    )
    batchjobs.patch(name, {"cancel": True})
    status = batchjobs.wait_phase(name, "Cancelled", "Succeeded", "Failed", timeout=RUN_TIMEOUT_S)
    assert status["phase"] == "Cancelled", status
    completed = status["requestCounts"]["completed"]
    assert 1 <= completed < total, status
    assert output_ids(volume / name / "out.jsonl") == [f"r{i}" for i in range(completed)]
    assert f"{name}/out.jsonl" in status["message"]
    assert planner.get(status["jobId"]).state == pb.JOB_STATE_CANCELLED
    assert "SpecImmutable" not in batchjobs.events(name)
