"""BatchJobs the schema lets through but that cannot run end Failed, with a condition saying why."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from operator_testbed import MODEL, BatchJobs


def _name() -> str:
    return f"bj-{uuid.uuid4().hex[:8]}"


def _failed_condition(status: dict[str, Any]) -> dict[str, Any]:
    (condition,) = [c for c in status["conditions"] if c["type"] == "Failed"]
    assert condition["status"] == "True"
    return condition


def _refused(batchjobs: BatchJobs, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Applies the BatchJob and returns the Failed condition it ends with."""
    batchjobs.apply(name, spec)
    return _failed_condition(batchjobs.wait_phase(name, "Failed", "Succeeded", "Running"))


def test_missing_configmap_marks_failed_with_condition(batchjobs: BatchJobs, operator: Any) -> None:
    name = _name()
    spec = {
        "model": MODEL,
        "input": {"configMap": {"name": "no-such-questions", "key": "in.jsonl"}},
        "output": {"path": f"{name}/out.jsonl"},
    }
    batchjobs.apply(name, spec)
    status = batchjobs.wait_phase(name, "Failed", "Succeeded", "Running")
    assert status["phase"] == "Failed"
    condition = _failed_condition(status)
    assert condition["reason"] == "InputNotFound"
    assert "no-such-questions" in condition["message"]
    assert "jobId" not in status  # nothing reached the planner
    assert "InputNotFound" in batchjobs.events(name)


def test_input_symlink_out_of_the_volume_marks_failed(
    batchjobs: BatchJobs, operator: Any, volume: Path, tmp_path: Path
) -> None:
    (tmp_path / "secret.jsonl").write_text('{"custom_id": "x"}\n')
    (volume / "escape").symlink_to(tmp_path)
    name = _name()
    spec = {
        "model": MODEL,
        "input": {"path": "escape/secret.jsonl"},
        "output": {"path": f"{name}/out.jsonl"},
    }
    condition = _refused(batchjobs, name, spec)
    assert condition["reason"] == "PathOutsideVolume"
    assert "outside" in condition["message"]


def test_empty_input_is_refused_by_the_planner(
    batchjobs: BatchJobs, operator: Any, volume: Path
) -> None:
    (volume / "empty.jsonl").write_text("\n")
    name = _name()
    spec = {"model": MODEL, "input": {"path": "empty.jsonl"}, "output": {"path": f"{name}.jsonl"}}
    condition = _refused(batchjobs, name, spec)
    assert condition["reason"] == "PlannerRejected"
    assert "FAILED_PRECONDITION" in condition["message"]


def test_unknown_model_is_refused_by_the_planner(batchjobs: BatchJobs, operator: Any) -> None:
    name = _name()
    spec = {
        "model": "no-such-model",
        "input": {
            "inline": [{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}]
        },
        "output": {"path": f"{name}.jsonl"},
    }
    condition = _refused(batchjobs, name, spec)
    assert condition["reason"] == "PlannerRejected"
    assert "no-such-model" in condition["message"]
