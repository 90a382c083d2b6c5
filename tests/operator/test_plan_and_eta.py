"""A BatchJob's plan and ETA: spec.dryRun plans the job and runs nothing (status.plan, through the
kube-apiserver, the operator and a real planner); a running job's status shows the planner's ETA,
and an ended one none."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from operator_testbed import MODEL, BatchJobs

from prefixgrove_operator.spec import BatchJobSpec
from prefixgrove_operator.status import JobView, final_status, job_status, job_view
from prefixgrove_proto import planner_pb2 as pb

RUN_TIMEOUT_S = 120.0


def running(**fields: Any) -> pb.Job:
    counts = pb.RequestCounts(total=10, completed=4)
    return pb.Job(id="job_1", state=pb.JOB_STATE_IN_PROGRESS, request_counts=counts, **fields)


def test_a_running_jobs_status_shows_its_eta() -> None:
    status = job_status(job_view(running(eta_s=754.2)), None)
    assert (status["eta"], status["etaSeconds"]) == ("12m", 754)


def test_an_unknown_eta_is_left_out_and_an_ended_job_clears_it() -> None:
    assert "eta" not in job_status(job_view(running(eta_s=-1.0)), None)
    ended = JobView("job_1", "Succeeded", 10, 10, 0, 1.0, 2.0, "")
    assert final_status(ended, None, "wrote out.jsonl")["eta"] is None


def test_a_dry_runs_plan_shows_in_status() -> None:
    plan = pb.JobPlan(requests=3, prompt_tokens=300, prefill_tokens=120, saved_share=0.6,
                      groups=1, largest_group=3, output_tokens=30, output_exact=True,
                      devices=[pb.DevicePlan(kind="h100", gpus=1, tensor_parallel_size=1,
                                             wall_s=3700, gpu_hours=1.03, calibration="h100/bfloat16"),
                               pb.DevicePlan(kind="a100", unavailable="no fp8")])  # fmt: skip
    job = pb.Job(id="job_1", state=pb.JOB_STATE_COMPLETED, dry_run=True, plan=plan)
    shown = job_status(job_view(job), None)["plan"]
    assert shown["saved"] == "60.0%" and shown["outputTokensExact"]
    assert shown["devices"] == [
        {"kind": "h100", "gpus": 1, "tensorParallelSize": 1, "wall": "61m", "gpuHours": 1.03,
         "calibration": "h100/bfloat16"},
        {"kind": "a100", "unavailable": "no fp8"},
    ]  # fmt: skip
    assert "plan" not in job_status(job_view(running(plan=plan)), None)  # a job that runs


def test_spec_dry_run_is_read() -> None:
    spec = {"model": MODEL, "input": {"inline": []}, "output": {"url": "s3://b/o.jsonl"}}
    assert not BatchJobSpec.parse(spec, "/data").dry_run
    assert BatchJobSpec.parse({**spec, "dryRun": True}, "/data").dry_run


def test_a_dry_run_batchjob_succeeds_with_its_plan_and_runs_nothing(
    batchjobs: BatchJobs, operator: Any, volume: Path
) -> None:
    name = f"plan-{uuid.uuid4().hex[:8]}"
    body = {"max_tokens": 4, "ignore_eos": True}
    requests = [{"custom_id": f"r{i}", "url": "/v1/completions",
                 "body": {**body, "prompt": "Shared instructions for all. " * 4 + str(i)}}
                for i in range(4)]  # fmt: skip
    batchjobs.apply(name, {"model": MODEL, "dryRun": True, "input": {"inline": requests},
                           "output": {"path": f"{name}/out.jsonl"}})  # fmt: skip
    status = batchjobs.wait_phase(name, "Succeeded", "Failed", timeout=RUN_TIMEOUT_S)
    assert status["phase"] == "Succeeded", status
    assert status["requestCounts"] == {"total": 4, "completed": 0, "failed": 0}
    plan = status["plan"]
    assert (plan["requests"], plan["groups"], plan["outputTokens"]) == (4, 1, 16)
    assert plan["devices"][0]["kind"] == "h100" and "eta" not in status
    assert (volume / name / "out.jsonl").read_text() == ""  # nothing ran
