"""With no worker running, jobs wait in the planner's queue: the autoscaler follows the queue depth,
and deleting a BatchJob cancels its planner job."""

from __future__ import annotations

import math
import time
import uuid
from pathlib import Path
from typing import Any

from k8s_fixtures import KubeApi
from operator_testbed import (
    AUTOSCALE_INTERVAL_S,
    GROUPS_PER_WORKER,
    MAX_WORKERS,
    MIN_WORKERS,
    MODEL,
    SCALE_DOWN_WINDOW_S,
    BatchJobs,
    replicas,
    start_worker,
)
from polling import wait_for

from prefixgrove.planner.client import PlannerClient
from prefixgrove_proto import planner_pb2 as pb

FINALIZER = "prefixgrove.io/cancel-job"


def grouped_requests(groups: int, per_group: int) -> list[dict[str, Any]]:
    """Requests sharing one long prefix per group (the tiny model's tokenizer is byte-level)."""
    shared = "Read the following document carefully and answer the question after it. " * 3
    return [
        {
            "custom_id": f"g{g}-q{q}",
            "url": "/v1/completions",
            "body": {"prompt": f"Document {g}. {shared} Question {q}?", "max_tokens": 2},
        }
        for g in range(groups)
        for q in range(per_group)
    ]


def queue_job(batchjobs: BatchJobs, groups: int) -> tuple[str, str]:
    name = f"queued-{uuid.uuid4().hex[:8]}"
    spec = {
        "model": MODEL,
        "input": {"inline": grouped_requests(groups, per_group=3)},
        "output": {"path": f"{name}/out.jsonl"},
    }
    batchjobs.apply(name, spec)
    # no worker runs in this module: the job waits Queued
    status = batchjobs.wait_phase(name, "Queued", "Failed", "Succeeded")
    assert status["phase"] == "Queued", status
    return name, status["jobId"]


def expected_replicas(depth: int) -> int:
    return max(MIN_WORKERS, min(MAX_WORKERS, math.ceil(depth / GROUPS_PER_WORKER)))


def test_deleting_a_running_batchjob_cancels_its_planner_job(
    batchjobs: BatchJobs, operator: Any, planner: PlannerClient, crd: KubeApi
) -> None:
    name, job_id = queue_job(batchjobs, groups=1)
    assert FINALIZER in batchjobs.get(name)["metadata"]["finalizers"]  # type: ignore[index]
    batchjobs.delete(name)
    assert planner.get(job_id).state == pb.JOB_STATE_CANCELLED


def test_rising_queue_depth_scales_the_workers_up_at_once(
    batchjobs: BatchJobs, operator: Any, planner: PlannerClient, crd: KubeApi
) -> None:
    # jobs earlier tests left queued count too
    before = expected_replicas(planner.queue_depth(MODEL).depth)
    wait_for(f"{before} worker replicas to start with", lambda: replicas(crd) == before, 30)
    name, _ = queue_job(batchjobs, groups=3)
    want = expected_replicas(planner.queue_depth(MODEL).depth)
    assert want > before, "the queue was already deep enough for the most workers"
    # NOTE: that scaling up skips the window is ScaleDecider's rule, checked against a driven clock
    # in test_units; a wall-clock bound here would fail on a busy machine.
    wait_for(f"{want} worker replicas", lambda: replicas(crd) == want, 30)
    batchjobs.delete(name)


def test_an_empty_queue_scales_the_workers_down_to_the_minimum_after_the_window(
    batchjobs: BatchJobs,
    operator: Any,
    planner: PlannerClient,
    crd: KubeApi,
    redis_url: str,
    logs_dir: Path,
) -> None:
    name, _ = queue_job(batchjobs, groups=2)
    wait_for("the workers to scale up", lambda: replicas(crd) > MIN_WORKERS, 30)
    # The last moment the queue is known to hold work: the scale-down window can only start after
    # it. (Measuring from when this test first sees the queue empty would let a busy machine, slow
    # to look, shorten the window it checks.)
    last_busy = time.monotonic()

    def queue_empty() -> bool:
        nonlocal last_busy
        seen = time.monotonic()
        if planner.queue_depth(MODEL).depth:
            last_busy = seen
            return False
        return True

    worker = start_worker(redis_url, logs_dir)  # drains the queue, this job's groups and any left
    try:
        batchjobs.wait_phase(name, "Succeeded", timeout=120)
        wait_for("an empty queue", queue_empty, 60)
        looked = time.monotonic()
        if looked - last_busy < SCALE_DOWN_WINDOW_S - AUTOSCALE_INTERVAL_S:
            assert replicas(crd) > MIN_WORKERS, "scaled down before the stabilization window passed"
        wait_for(f"{MIN_WORKERS} worker replica", lambda: replicas(crd) == MIN_WORKERS, 30)
        # the queue emptied after last_busy, and the autoscaler waits a whole window after that
        assert time.monotonic() - last_busy >= SCALE_DOWN_WINDOW_S - AUTOSCALE_INTERVAL_S
    finally:
        worker.stop()
