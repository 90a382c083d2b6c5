"""CreateJob with dry_run over real gRPC and a real redis-server: the input is read and grouped as
for a run, the sealed job ends completed with its plan, and nothing is queued."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from services_testbed import MODEL, RedisServer, batch_line

from prefixgrove.cli import main as cli
from prefixgrove.jobs.redis_store.schema import JobKeys
from prefixgrove.planner.client import PlannerClient, PlannerError
from prefixgrove.planner.server import PlannerServer, build_server
from prefixgrove.settings import IngestSettings, PlannerSettings, SecuritySettings
from prefixgrove_proto import planner_pb2 as pb

SHARED = "Shared instructions for every request. " * 4
MAX_MODEL_LEN = 512


@pytest.fixture
def planner(redis_server: RedisServer) -> Iterator[tuple[PlannerClient, PlannerServer]]:
    settings = PlannerSettings(redis_url=redis_server.url, host="127.0.0.1", port=0, model=MODEL)
    server = build_server(settings, IngestSettings(max_model_len=MAX_MODEL_LEN), SecuritySettings())
    client = PlannerClient(f"127.0.0.1:{server.port}")
    yield client, server
    client.close()
    server.stop(0)


def lines(n: int) -> list[str]:
    body = {"max_tokens": 4, "ignore_eos": True, "temperature": 0}
    return [batch_line(f"r{i}", {**body, "prompt": f"{SHARED}item {i}"}) for i in range(n)]


def test_a_dry_run_ends_completed_with_its_plan_and_queues_nothing(
    planner: tuple[PlannerClient, PlannerServer], redis_server: RedisServer
) -> None:
    client, _ = planner
    options = pb.PlanOptions(gpu="h200", gpus=2, price_per_gpu_hour=3.0)
    job = client.create_job(dry_run=options)
    assert job.dry_run and job.state == pb.JOB_STATE_VALIDATING
    client.add_lines(job.id, [line.encode() for line in lines(8)] + [b"{broken"])
    sealed = client.seal(job.id)
    assert sealed.state == pb.JOB_STATE_COMPLETED and sealed.groups_total == 0
    assert sealed.request_counts.total == 9 and sealed.request_counts.failed == 1
    assert client.queue_depth(MODEL).depth == 0
    plan = sealed.plan
    assert (plan.requests, plan.invalid_lines, plan.groups, plan.largest_group) == (8, 1, 1, 8)
    assert plan.output_exact and plan.output_tokens == 32
    assert plan.prompt_tokens - plan.prefill_tokens == sealed.prefix_tokens_saved > 0
    h200 = plan.devices[0]  # the kind planned for comes first
    assert h200.kind == "h200"
    assert h200.gpus == 2 and h200.cost == pytest.approx(h200.gpu_hours * 3.0)
    assert client.get(job.id).plan == plan  # kept with the job
    assert not redis_server.client().exists(JobKeys(job.id).requests)  # nothing will run them


def test_a_dry_run_plans_as_prefixgrove_plan_does(
    planner: tuple[PlannerClient, PlannerServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client, _ = planner
    job = client.create_job(dry_run=pb.PlanOptions(gpu="h100"))
    client.add_lines(job.id, [line.encode() for line in lines(6)])
    remote = client.seal(job.id).plan
    path = tmp_path / "in.jsonl"
    path.write_text("".join(line + "\n" for line in lines(6)))
    args = ["plan", str(path), "--model", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--json"]
    assert cli(args) == 0
    local = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (remote.prefill_tokens, remote.groups, remote.output_tokens) == (
        local["prefill_tokens"], local["groups"], local["output_tokens"])  # fmt: skip
    assert remote.devices[0].wall_s == pytest.approx(local["devices"]["h100"]["wall_s"])


def test_a_job_that_runs_keeps_a_plan_for_its_eta(
    planner: tuple[PlannerClient, PlannerServer],
) -> None:
    client, _ = planner
    job = client.create_job()
    client.add_lines(job.id, [line.encode() for line in lines(2)])
    sealed = client.seal(job.id)
    assert not sealed.dry_run and sealed.state == pb.JOB_STATE_IN_PROGRESS
    assert sealed.groups_total >= 1 and sealed.plan.requests == 2
    assert sealed.plan.devices[0].kind == "h100"  # one engine of the default kind
    assert 0 <= sealed.eta_s <= sealed.plan.devices[0].wall_s  # known: -1 is unknown


@pytest.mark.parametrize(
    ("options", "named"),
    [(pb.PlanOptions(gpu="tpu"), "tpu"), (pb.PlanOptions(quantization="int4"), "int4"),
     (pb.PlanOptions(price_per_gpu_hour=-2), "price_per_gpu_hour=-2.0")],
)  # fmt: skip
def test_bad_plan_options_are_refused_by_name(
    planner: tuple[PlannerClient, PlannerServer], options: pb.PlanOptions, named: str
) -> None:
    client, _ = planner
    with pytest.raises(PlannerError) as info:
        client.create_job(dry_run=options)
    assert named in str(info.value) and client.list() == []
