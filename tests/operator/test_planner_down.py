"""A planner that is down when a BatchJob arrives: the BatchJob waits as Pending, then runs once the
planner is back. The operator runs here as its own process, pointed at a port nobody listens on yet."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_fixtures import KubeApi, free_port
from operator_testbed import MODEL, BatchJobs, Service, start_planner
from polling import wait_for

NAMESPACE = "planner-down"


@pytest.fixture
def late_planner_port(crd: KubeApi, volume: Path, logs_dir: Path) -> Iterator[int]:
    """An operator process whose planner port is free; the test starts the planner there later."""
    crd.kubectl("create", "namespace", NAMESPACE, check=False)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGROVE_")}
    env.update(
        KUBECONFIG=str(crd.kubeconfig),
        PREFIXGROVE_PLANNER_ADDRESS=f"127.0.0.1:{port}",
        PREFIXGROVE_RPC_TIMEOUT_S="1",
        PREFIXGROVE_RETRY_DELAY_S="1",
        PREFIXGROVE_STATUS_INTERVAL_S="0.5",
        PREFIXGROVE_SHARED_VOLUME_ROOT=str(volume),
        PREFIXGROVE_WORKER_DEPLOYMENT="",  # no autoscaling here
    )
    args = [sys.executable, "-m", "kopf", "run", "--standalone", f"--namespace={NAMESPACE}",
            "-m", "prefixgrove_operator.handlers"]  # fmt: skip
    operator = Service("operator", args, env, logs_dir)
    yield port
    operator.stop()


def test_a_batchjob_waits_pending_for_the_planner_then_runs(
    crd: KubeApi, late_planner_port: int, redis_url: str, logs_dir: Path
) -> None:
    jobs = BatchJobs(crd, namespace=NAMESPACE)
    name = f"early-{uuid.uuid4().hex[:8]}"
    request = {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi"}}
    jobs.apply(
        name, {"model": MODEL, "input": {"inline": [request]}, "output": {"path": f"{name}.jsonl"}}
    )
    # Pending from its creation on; the operator's first try adds why it still is
    pending = wait_for(
        "the operator to say it waits", lambda: (s := jobs.status(name)).get("message") and s, 60
    )
    assert pending["phase"] == "Pending"
    assert "waiting for the planner" in pending["message"]
    assert "UNAVAILABLE" in pending["message"]
    planner, _ = start_planner(redis_url, logs_dir, port=late_planner_port)
    try:
        # no worker runs here: the job waits Queued once the planner has it
        running = jobs.wait_phase(name, "Queued", "Running", "Succeeded", "Failed", timeout=60)
        assert running["phase"] in ("Queued", "Running", "Succeeded"), running
        assert running["jobId"]
        assert "message" not in running
        jobs.delete(name)
    finally:
        planner.stop()
