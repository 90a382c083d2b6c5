"""A BatchJob's status agrees with itself: a phase from its creation on, Queued until a worker runs
it, observedGeneration following the spec, and a job the operator stopped Failed, not also
Cancelled. No worker runs in this module."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from operator_testbed import MODEL, BatchJobs, PhaseWatch
from polling import wait_for


def _request(custom_id: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "url": "/v1/completions", "body": {"prompt": "Hi", **body}}


def _spec(name: str, *requests: dict[str, Any], **extra: Any) -> dict[str, Any]:
    inline = list(requests) or [_request("a")]
    return {
        "model": MODEL,
        "input": {"inline": inline},
        "output": {"path": f"{name}.jsonl"},
        **extra,
    }


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions", [])}


def test_a_batchjob_shows_a_phase_in_every_version_from_its_creation_on(
    batchjobs: BatchJobs, operator: Any, logs_dir: Path
) -> None:
    name = f"phase-{uuid.uuid4().hex[:8]}"
    with PhaseWatch(batchjobs.kube, name, logs_dir) as watch:
        wait_for("the watch to start", lambda: watch.proc.poll() is None and watch.out.exists())
        batchjobs.apply(name, _spec(name))
        batchjobs.wait_phase(name, "Queued")
        events = wait_for("the watch to see Queued", lambda: "Queued" in watch.phases() and watch)
        versions = [e["object"] for e in events.events()]
    phases = [(v.get("status") or {}).get("phase") for v in versions]
    assert phases[0] == "Pending" and all(phases), phases
    batchjobs.delete(name)


def test_a_job_whose_lines_the_planner_refused_stays_queued_until_a_worker_runs_it(
    batchjobs: BatchJobs, operator: Any
) -> None:
    name = f"refused-{uuid.uuid4().hex[:8]}"
    batchjobs.apply(name, _spec(name, _request("good"), _request("bad", max_tokens=0)))
    status = batchjobs.wait_phase(name, "Queued", "Running", "Failed", "Succeeded")
    assert status["phase"] == "Queued", status
    assert status["requestCounts"] == {"total": 2, "completed": 0, "failed": 1}
    batchjobs.delete(name)


def test_observed_generation_follows_the_spec(batchjobs: BatchJobs, operator: Any) -> None:
    name = f"generation-{uuid.uuid4().hex[:8]}"
    batchjobs.apply(name, _spec(name))
    status = batchjobs.wait_phase(name, "Queued")
    assert status["observedGeneration"] == 1
    batchjobs.patch(name, {"cancel": True})
    batchjobs.wait_phase(name, "Cancelled")
    wait_for("observedGeneration 2", lambda: batchjobs.status(name)["observedGeneration"] == 2)
    # a change the operator ignores (it only warns) is seen all the same
    batchjobs.patch(name, {"maxFailedRatio": 0.5})
    wait_for("observedGeneration 3", lambda: batchjobs.status(name)["observedGeneration"] == 3)
    assert batchjobs.get(name)["metadata"]["generation"] == 3  # type: ignore[index]
    batchjobs.delete(name)


def test_a_job_the_operator_stops_ends_failed_and_not_also_cancelled(
    batchjobs: BatchJobs, operator: Any
) -> None:
    name = f"stopped-{uuid.uuid4().hex[:8]}"
    batchjobs.apply(name, _spec(name, queueTimeoutSeconds=1))
    status = batchjobs.wait_phase(name, "Failed", "Cancelled", "Succeeded", timeout=60)
    assert status["phase"] == "Failed", status
    conditions = _conditions(status)
    assert conditions["Failed"]["reason"] == "Unserved"
    assert "Cancelled" not in conditions, conditions
    assert conditions["FailureTarget"]["reason"] == "Unserved"
    batchjobs.delete(name)


def test_a_job_whose_every_line_was_refused_still_gets_its_errors_file(
    batchjobs: BatchJobs, operator: Any, volume: Path
) -> None:
    """Its planner job is final at the seal: the BatchJob waits Finalizing for its last results."""
    name = f"refused-all-{uuid.uuid4().hex[:8]}"
    batchjobs.apply(name, _spec(name, _request("x", max_tokens=0), _request("y", max_tokens=0)))
    status = batchjobs.wait_phase(name, "Succeeded", "Failed")
    assert status["phase"] == "Succeeded", status
    errors = (volume / f"{name}.jsonl.errors.jsonl").read_text().splitlines()
    assert [json.loads(line)["custom_id"] for line in errors] == ["x", "y"]
    assert (volume / f"{name}.jsonl").read_text() == ""
