"""The operator's pure parts: settings, the scaling rule, spec parsing and path confinement, status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixgrove_operator.autoscaler import ScaleDecider, desired_replicas
from prefixgrove_operator.results import append_new_results, failure_of
from prefixgrove_operator.settings import OperatorSettings
from prefixgrove_operator.spec import BatchJobSpec, InvalidSpec, confine, on_volume
from prefixgrove_operator.status import (
    JobView,
    final_status,
    job_status,
    job_view,
    progress,
    with_condition,
)
from prefixgrove_operator.verdicts import stop_verdict
from prefixgrove_proto import planner_pb2 as pb


def test_settings_read_prefixed_env_with_types() -> None:
    s = OperatorSettings.from_env(
        {"PREFIXGROVE_MAX_WORKERS": "3", "PREFIXGROVE_SCALE_DOWN_WINDOW_S": "1.5", "OTHER": "x"}
    )
    assert (s.max_workers, s.scale_down_window_s, s.min_workers) == (3, 1.5, 0)


def test_settings_reject_nonsense_with_the_value() -> None:
    with pytest.raises(ValueError, match="PREFIXGROVE_GROUPS_PER_WORKER='many'"):
        OperatorSettings.from_env({"PREFIXGROVE_GROUPS_PER_WORKER": "many"})
    with pytest.raises(ValueError, match="max_workers=1, min_workers=2"):
        OperatorSettings(min_workers=2, max_workers=1)
    with pytest.raises(ValueError, match="groups_per_worker must be >= 1, got 0"):
        OperatorSettings(groups_per_worker=0)


@pytest.mark.parametrize(
    ("depth", "expected"), [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (100, 5), (-3, 0)]
)
def test_desired_replicas_is_clamped_ceiling(depth: int, expected: int) -> None:
    assert desired_replicas(depth, groups_per_worker=4, lo=0, hi=5) == expected


def test_desired_replicas_respects_minimum() -> None:
    assert desired_replicas(0, groups_per_worker=4, lo=2, hi=5) == 2


# (groups_per_worker, min_replicas, window_s), then (now, depth, current, expected) per call
DECISIONS = {
    "scale_up_is_immediate": ((2, 0, 60), [(0.0, 0, 0, 0), (1.0, 7, 0, 4)]),
    # the depth-8 recommendation at t=0 leaves the window at t=61; t=59 still asks for 1
    "scale_down_waits_for_the_window": (
        (2, 0, 60),
        [(0.0, 8, 0, 4), (10.0, 0, 4, 4), (59.0, 2, 4, 4), (61.0, 0, 4, 1), (120.0, 0, 1, 0)],
    ),
    "fresh_decider_does_not_scale_down_before_a_window": (
        (1, 0, 30),
        [(100.0, 0, 3, 3), (131.0, 0, 3, 0)],
    ),
    "zero_window_scales_down_at_once": ((1, 1, 0), [(0.0, 5, 5, 5), (1.0, 0, 5, 1)]),
}


@pytest.mark.parametrize(("setup", "calls"), DECISIONS.values(), ids=DECISIONS.keys())
def test_scale_decider(
    setup: tuple[int, int, float], calls: list[tuple[float, int, int, int]]
) -> None:
    per_worker, lo, window = setup
    decider = ScaleDecider(per_worker, min_replicas=lo, max_replicas=10, window_s=window)
    for now, depth, current, expected in calls:
        assert decider.decide(now, depth=depth, current=current) == expected, (now, depth)


def test_confine_keeps_paths_inside_the_volume(tmp_path: Path) -> None:
    assert confine(str(tmp_path), "in/a.jsonl", "p") == tmp_path.resolve() / "in" / "a.jsonl"
    for escape in ("/etc/passwd", "../x", "a/../../x"):
        with pytest.raises(InvalidSpec, match="inside the shared volume") as info:
            confine(str(tmp_path), escape, "spec.input.path")
        assert info.value.reason == "PathOutsideVolume"


def test_confine_refuses_a_symlink_out_of_the_volume(tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "link").symlink_to(tmp_path)
    with pytest.raises(InvalidSpec, match="outside"):
        confine(str(volume), "link/secret", "spec.input.path")


def _spec(**overrides: object) -> dict[str, object]:
    spec: dict[str, object] = {
        "model": "tiny",
        "input": {
            "inline": [{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}]
        },
        "output": {"path": "out/a.jsonl"},
    }
    spec.update(overrides)
    return spec


def test_spec_defaults_errors_path_beside_output(tmp_path: Path) -> None:
    parsed = BatchJobSpec.parse(_spec(), str(tmp_path))
    assert parsed.errors_path == tmp_path.resolve() / "out" / "a.jsonl.errors.jsonl"


def test_spec_needs_exactly_one_input(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpec, match=r"exactly one of inline, configMap, path, url; got \[\]"):
        BatchJobSpec.parse(_spec(input={}), str(tmp_path))
    with pytest.raises(InvalidSpec, match="got \\['inline', 'path'\\]"):
        BatchJobSpec.parse(_spec(input={"inline": [], "path": "a"}), str(tmp_path))


def test_sampling_defaults_fill_only_missing_body_fields(tmp_path: Path) -> None:
    inline = [
        {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 3}},
        {"custom_id": "b", "url": "/v1/chat/completions", "body": {"messages": []}},
    ]
    sampling = {"maxTokens": 9, "temperature": 0, "logprobs": 2, "ignoreEos": True}
    parsed = BatchJobSpec.parse(_spec(input={"inline": inline}, sampling=sampling), str(tmp_path))
    first, second = (json.loads(line) for line in parsed.request_lines(None, "ns"))  # type: ignore[arg-type]
    assert first["body"] == {
        "prompt": "x",
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": 2,
        "ignore_eos": True,
    }
    assert second["body"]["logprobs"] is True and second["body"]["top_logprobs"] == 2
    assert second["body"]["max_tokens"] == 9


def test_path_input_must_exist_before_anything_is_sent(tmp_path: Path) -> None:
    parsed = BatchJobSpec.parse(_spec(input={"path": "missing.jsonl"}), str(tmp_path))
    with pytest.raises(InvalidSpec, match="is absent from the volume") as info:
        parsed.request_lines(None, "ns")  # type: ignore[arg-type]
    assert info.value.reason == "InputNotFound"


def test_path_input_drops_blank_lines(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"a":1}\n\n{"b":2}\r\n')
    parsed = BatchJobSpec.parse(_spec(input={"path": "in.jsonl"}), str(tmp_path))
    assert list(parsed.request_lines(None, "ns")) == [b'{"a":1}', b'{"b":2}']  # type: ignore[arg-type]


def test_progress_rounds_down() -> None:
    assert (progress(0, 0), progress(1, 3), progress(3, 3)) == ("0%", "33%", "100%")


def test_condition_keeps_transition_time_while_status_holds() -> None:
    first = with_condition(None, "Submitted", True, "Submitted", "job 1")
    first[0]["lastTransitionTime"] = "2020-01-01T00:00:00Z"
    again = with_condition(first, "Submitted", True, "Submitted", "job 1 again")
    assert again[0]["lastTransitionTime"] == "2020-01-01T00:00:00Z"
    flipped = with_condition(again, "Submitted", False, "Lost", "gone")
    assert flipped[0]["lastTransitionTime"] != "2020-01-01T00:00:00Z"
    assert len(flipped) == 1


def test_a_failed_planner_job_is_finalizing_until_its_results_are_written() -> None:
    job = JobView("j1", "Failed", 0, 0, 0, 0.0, 1_700_000_000.0, "empty_file: no requests")
    assert job_status(job, None)["phase"] == "Finalizing"
    status = final_status(job, None, "wrote 0 outputs")
    assert status["phase"] == "Failed"
    assert status["completionTime"] == "2023-11-14T22:13:20Z"
    assert status["conditions"][0]["message"] == "empty_file: no requests"
    assert status["message"] == "empty_file: no requests; wrote 0 outputs"


def test_a_job_the_operator_stopped_ends_failed_and_never_also_cancelled() -> None:
    job = JobView("j1", "Cancelled", 4, 1, 2, 1.0, 2.0, "")
    status = final_status(job, None, "wrote 1 outputs", ("TooManyFailedRequests", "2 of 4"))
    assert status["phase"] == "Failed"
    assert [(c["type"], c["reason"]) for c in status["conditions"]] == [
        ("Failed", "TooManyFailedRequests")
    ]


def test_the_operator_loads_without_the_engine_stack() -> None:
    """Its image has no torch, transformers, numpy or redis; none may be imported on the way."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for m in ('torch', 'transformers', 'numpy', 'triton', 'redis'): sys.modules[m] = None\n"
        "import prefixgrove_operator.handlers\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_messages_users_read_name_no_path_of_the_operators_machine(tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "link").symlink_to(tmp_path)
    with pytest.raises(InvalidSpec) as escaped:
        confine(str(volume), "link/secret", "spec.input.path")
    spec = BatchJobSpec.parse(
        _spec(input={"path": "in/missing.jsonl"}, output={"path": "out/o.jsonl"}), str(volume)
    )
    with pytest.raises(InvalidSpec) as missing:
        list(spec.request_lines(None, "default"))  # type: ignore[arg-type]
    for message in (str(escaped.value), str(missing.value)):
        assert str(tmp_path) not in message, message
    assert "'in/missing.jsonl' is absent" in str(missing.value)
    assert on_volume(str(volume), spec.output_path) == "out/o.jsonl"


def _running(leased: int = 0, done: int = 0, completed: int = 0) -> pb.Job:
    return pb.Job(
        id="j1",
        state=pb.JOB_STATE_IN_PROGRESS,
        request_counts=pb.RequestCounts(total=4, completed=completed),
        queue=pb.QueueDepth(groups_waiting=1, groups_leased=leased),
        groups_done=done,
    )


def test_a_job_no_worker_has_leased_from_is_queued() -> None:
    assert job_view(_running()).phase == "Queued"
    # lines the planner refused itself are failed, yet no worker ran anything
    refused = _running()
    refused.request_counts.failed = 2
    assert job_view(refused).phase == "Queued"
    assert job_view(_running(leased=1)).phase == "Running"
    assert job_view(_running(done=1)).phase == "Running"


def _view(failed: int, total: int = 4, phase: str = "Running") -> JobView:
    return JobView("j1", phase, total, total - failed, failed, 1.0, 0.0, "")


def _job_spec(tmp_path: Path, **extra: object) -> BatchJobSpec:
    return BatchJobSpec.parse(
        _spec(input={"path": "in.jsonl"}, output={"path": "o.jsonl"}, **extra), str(tmp_path)
    )


def test_failures_above_max_failed_ratio_stop_the_job(tmp_path: Path) -> None:
    spec = _job_spec(tmp_path, maxFailedRatio=0.25)
    assert stop_verdict(_view(failed=1), spec, OperatorSettings(), 0.0) is None
    verdict = stop_verdict(_view(failed=2), spec, OperatorSettings(), 0.0)
    assert verdict is not None and verdict.reason == "TooManyFailedRequests"
    assert "2 of 4 requests failed" in verdict.message


def test_a_job_queued_past_its_timeout_is_stopped_as_unserved(tmp_path: Path) -> None:
    spec = _job_spec(tmp_path, queueTimeoutSeconds=30)
    queued = _view(failed=0, phase="Queued")
    assert stop_verdict(queued, spec, OperatorSettings(), 29.0) is None
    verdict = stop_verdict(queued, spec, OperatorSettings(), 30.0)
    assert verdict is not None and verdict.reason == "Unserved"
    default = stop_verdict(queued, _job_spec(tmp_path), OperatorSettings(queue_timeout_s=50), 49.0)
    assert default is None


def test_requests_failed_condition_carries_counts_and_the_first_failure() -> None:
    status = job_status(_view(failed=1), None, "request line 2: invalid_json: not JSON")
    (condition,) = [c for c in status["conditions"] if c["type"] == "RequestsFailed"]
    assert condition["message"] == (
        "1 of 4 requests failed (3 completed); the first: request line 2: invalid_json: not JSON"
    )


def test_a_failure_names_its_one_based_request_line() -> None:
    line = json.dumps(
        {"custom_id": "b", "error": {"code": "invalid_json", "message": "line is not valid JSON"}}
    )
    assert str(failure_of(1, line)) == (
        "request line 2 (custom_id 'b'): invalid_json: line is not valid JSON"
    )


class _Answered:
    """The planner's results stream, as far as the operator reads it: lines from an offset."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def results(self, job_id: str, offset: int, kind: object, unanswered: bool = False) -> list:
        return [pb.ResultLine(index=i, line=self.lines[i]) for i in range(offset, len(self.lines))]


def test_results_resumed_into_a_file_cut_short_start_over_with_whole_lines(tmp_path: Path) -> None:
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    lines = [json.dumps({"custom_id": f"r{i}"}) for i in range(3)]
    append_new_results(_Answered(lines[:2]), "j", out, err, finished=False)
    out.write_bytes(b"")  # the file on the volume was cut (or replaced) since the marker
    append_new_results(_Answered(lines), "j", out, err, finished=True)
    assert out.read_text().splitlines() == lines
    assert b"\0" not in out.read_bytes()
