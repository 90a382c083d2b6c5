"""The whole system on CPU with the tiny model: a redis-server with AOF (fsync on every write), the
planner and two workers as real processes, gRPC on loopback. Its output must equal `prefixgrove run`
line for line, through a worker killed mid-group, a planner restart, a Redis restart and a cancel.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from run_tags import as_job
from services_testbed import (
    MODEL,
    ServiceStack,
    free_port,
    local_run,
    logprobs_job,
    service_env,
    service_stack,
    shared_prefix_job,
    wait_until,
)

from prefixgrove_proto import planner_pb2 as pb

LEASE_TIMEOUT_S = "3"


@pytest.fixture(scope="module")
def metrics_ports() -> tuple[int, int]:
    """The planner's and worker w2's metrics ports."""
    return free_port(), free_port()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, metrics_ports: tuple[int, int]
) -> Iterator[ServiceStack]:
    planner_metrics, worker_metrics = metrics_ports
    with service_stack(
        tmp_path_factory.mktemp("stack"),
        workers={"w1": (), "w2": ("--metrics-port", str(worker_metrics))},
        planner_args=("--metrics-port", str(planner_metrics)),
        worker_args=("--lease-timeout-s", LEASE_TIMEOUT_S, "--max-groups-in-flight", "2",
                     "--cancel-poll-s", "0.5"),
        aof=True,
    ) as stack:  # fmt: skip
        yield stack


@pytest.fixture(scope="module")
def long_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A job that runs for several seconds, and its output from the local run."""
    d = tmp_path_factory.mktemp("long")
    job = shared_prefix_job(d / "in.jsonl", 240, max_tokens=24, docs=8, with_errors=True)
    return job, *local_run(job, d)


def finish(
    stack: ServiceStack, job_id: str, d: Path, timeout: float = 120
) -> tuple[pb.Job, Path, Path]:
    client = stack.client()
    wait_until(lambda: client.get(job_id).state in (pb.JOB_STATE_COMPLETED, pb.JOB_STATE_CANCELLED),
               timeout, f"job {job_id} to end")  # fmt: skip
    out, err = d / "out.jsonl", d / "out.errors.jsonl"
    client.download(job_id, out, err)
    return client.get(job_id), out, err


def answered(stack: ServiceStack, job_id: str) -> int:
    counts = stack.client().get(job_id).request_counts
    return counts.completed + counts.failed


def test_planner_and_two_workers_equal_the_local_run(stack: ServiceStack, tmp_path: Path) -> None:
    job_file = shared_prefix_job(tmp_path / "in.jsonl", 300, with_errors=True)
    local_out, local_err = local_run(job_file, tmp_path)
    client = stack.client()
    job = client.submit_file(job_file)
    assert job.groups_total > 1 and job.prefix_tokens_saved > 0
    done, out, err = finish(stack, job.id, tmp_path)
    assert done.state == pb.JOB_STATE_COMPLETED
    assert done.request_counts == pb.RequestCounts(total=303, completed=299, failed=4)
    assert out.read_text() == as_job(local_out, job.id)
    assert err.read_text() == as_job(local_err, job.id)
    assert client.queue_depth(MODEL).depth == 0


def test_a_logprobs_job_through_the_services_equals_the_local_run(
    stack: ServiceStack, tmp_path: Path
) -> None:
    """Logprobs are printed to the last bit of their float: the workers batch the job otherwise than
    the local run (other groups beside each, other step sizes), and every value must still match."""
    job_file = logprobs_job(tmp_path / "in.jsonl", 90)
    local_out, _ = local_run(job_file, tmp_path)
    job = stack.client().submit_file(job_file)
    assert job.groups_total > 1
    done, out, _ = finish(stack, job.id, tmp_path)
    assert done.request_counts == pb.RequestCounts(total=90, completed=90)
    lines = out.read_text().splitlines()
    assert all(json.loads(line)["response"]["body"]["choices"][0]["logprobs"] for line in lines)
    assert {len(json.loads(line)["response"]["body"]["choices"]) for line in lines} == {1, 2, 3}
    assert lines == as_job(local_out, job.id).splitlines()


def test_a_worker_killed_mid_group_is_taken_over(
    stack: ServiceStack, long_job: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    job_file, local_out, local_err = long_job
    r = stack.redis.client()
    job = stack.client().submit_file(job_file)
    queue = f"pg:queue:{MODEL}"

    def w1_mid_group() -> bool:
        held = r.xpending_range(queue, "workers", "-", "+", 10, consumername="w1")
        return bool(held) and answered(stack, job.id) > 10

    wait_until(w1_mid_group, 60, "w1 to hold a group after some results")
    stack.workers["w1"].kill()  # SIGKILL: no chance to give anything back
    done, out, err = finish(stack, job.id, tmp_path)
    assert done.state == pb.JOB_STATE_COMPLETED
    assert "took over group" in stack.workers["w2"].text()
    ids = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == done.request_counts.completed
    assert out.read_text() == as_job(local_out, job.id) and err.read_text() == as_job(
        local_err, job.id
    )
    stack.add_worker("w3", "--drain-timeout-s", "1")


def test_a_stopped_worker_gives_its_groups_back(
    stack: ServiceStack, long_job: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    job_file, local_out, _ = long_job
    r = stack.redis.client()
    queue = f"pg:queue:{MODEL}"
    # w3 started at the end of the last test; on a loaded machine it may still be importing torch,
    # and the other worker could finish the whole job before it reads the queue.
    wait_until(
        lambda: "worker w3 serving" in stack.workers["w3"].text(), 120, "w3 to start serving"
    )
    job = stack.client().submit_file(job_file)
    wait_until(lambda: bool(r.xpending_range(queue, "workers", "-", "+", 10, consumername="w3")), 90,
               "w3 to hold a group")  # fmt: skip
    stack.workers["w3"].kill(signal.SIGTERM)
    assert stack.workers["w3"].wait(30) == 0
    # It finished or gave back (claimable at once) every group it held: none waits for a timeout.
    assert r.xpending_range(queue, "workers", "-", "+", 10, consumername="w3") == []
    done, out, _ = finish(stack, job.id, tmp_path)
    assert done.state == pb.JOB_STATE_COMPLETED and out.read_text() == as_job(local_out, job.id)
    stack.add_worker("w4")


def test_cli_submits_waits_downloads_and_metrics_are_served(
    stack: ServiceStack, metrics_ports: tuple[int, int], tmp_path: Path
) -> None:
    job_file = shared_prefix_job(tmp_path / "in.jsonl", 40, seed=3)
    out = tmp_path / "out.jsonl"
    cli = [sys.executable, "-m", "prefixgrove.cli"]
    target = ["--planner", f"127.0.0.1:{stack.port}", "--json"]
    submit = subprocess.run([*cli, "submit", str(job_file), *target, "--wait", "-o", str(out)],
                            capture_output=True, text=True, timeout=120, env=service_env())  # fmt: skip
    assert submit.returncode == 0, submit.stderr[-2000:]
    first = json.loads(submit.stdout.splitlines()[0])
    assert json.loads(submit.stdout.splitlines()[-1])["completed"] == 40
    assert len(out.read_text().splitlines()) == 40
    status = subprocess.run([*cli, "status", first["id"], *target], capture_output=True, text=True,
                            timeout=60, env=service_env())  # fmt: skip
    assert json.loads(status.stdout)["state"] == "JOB_STATE_COMPLETED"
    planner_port, worker_port = metrics_ports
    planner_metrics = (
        urllib.request.urlopen(f"http://127.0.0.1:{planner_port}/metrics").read().decode()
    )
    assert "prefixgrove_queue_depth" in planner_metrics
    assert "prefixgrove_planner_requests_accepted_total" in planner_metrics
    worker_metrics = (
        urllib.request.urlopen(f"http://127.0.0.1:{worker_port}/metrics").read().decode()
    )
    done = [
        line
        for line in worker_metrics.splitlines()
        if line.startswith("prefixgrove_worker_requests_done_total")
    ]
    assert done and float(done[0].split()[-1]) > 0


def submit_and_wait_for_results(stack: ServiceStack, job_file: Path) -> pb.Job:
    """A job under way: some results written, more to come."""
    job = stack.client().submit_file(job_file)
    wait_until(lambda: answered(stack, job.id) > 10, 60, "first results")
    assert stack.client().get(job.id).state == pb.JOB_STATE_IN_PROGRESS
    return job


def test_the_job_completes_across_a_planner_restart(
    stack: ServiceStack, long_job: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    job_file, local_out, _ = long_job
    job = submit_and_wait_for_results(stack, job_file)
    stack.restart_planner()
    done, out, _ = finish(stack, job.id, tmp_path)
    assert done.state == pb.JOB_STATE_COMPLETED
    assert out.read_text() == as_job(local_out, job.id)


def test_the_job_completes_across_a_redis_restart(
    stack: ServiceStack, long_job: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    job_file, local_out, local_err = long_job
    job = submit_and_wait_for_results(stack, job_file)
    stack.redis.kill()
    time.sleep(1.0)
    stack.redis.start()  # same port and directory: the append-only file brings everything back
    done, out, err = finish(stack, job.id, tmp_path, timeout=180)
    assert done.state == pb.JOB_STATE_COMPLETED
    assert done.request_counts.completed + done.request_counts.failed == done.request_counts.total
    assert out.read_text() == as_job(local_out, job.id) and err.read_text() == as_job(
        local_err, job.id
    )


def test_cancel_mid_job_keeps_partial_results(
    stack: ServiceStack, long_job: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    job_file, local_out, _ = long_job
    client = stack.client()
    job = client.submit_file(job_file)
    wait_until(lambda: client.get(job.id).request_counts.completed > 5, 60, "first results")
    assert client.cancel(job.id).state in (pb.JOB_STATE_CANCELLING, pb.JOB_STATE_CANCELLED)
    # a cancel that did not reach the workers would end the job completed, never cancelled
    wait_until(lambda: client.get(job.id).state == pb.JOB_STATE_CANCELLED, 60, "the cancel to land")
    done, out, _ = finish(stack, job.id, tmp_path)
    counts = done.request_counts
    assert 0 < counts.completed < counts.total - counts.failed
    kept = out.read_text().splitlines()
    assert len(kept) == counts.completed
    reference = {
        json.loads(line)["custom_id"]: line for line in as_job(local_out, job.id).splitlines()
    }
    assert all(reference[json.loads(line)["custom_id"]] == line for line in kept)
    wait_until(lambda: client.queue_depth(MODEL).depth == 0, 30, "the cancelled groups to drain")
