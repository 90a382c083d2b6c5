"""One planner serving two models and a worker per model, as real processes over a real Redis: each
line of a mixed job runs on the worker pool of the model its body names, and the answers equal
`prefixgrove run` of that model over the same file. A line naming a model nobody serves is a
`model_not_found` line; the rest of the job runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from run_tags import as_job
from services_testbed import (
    MODEL,
    RedisServer,
    ServiceStack,
    batch_line,
    local_run,
    planner_in_process,
    service_stack,
    shared_prefix_job,
    wait_until,
)

from prefixgrove.jobs.redis_store import schema
from prefixgrove.jobs.redis_store.schema import JobKeys
from prefixgrove.planner.client import PlannerClient, PlannerError
from prefixgrove.settings import IngestSettings
from prefixgrove_proto import planner_pb2 as pb

SECOND = "second"  # the same source served under a second name: its own queue and workers
UNKNOWN = "nobody-serves-this"
ALIAS = "gpt-4o-mini"  # another name of SECOND, as a file written for another provider says


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceStack]:
    workers = {"first": (), "second": ("--served-model-name", SECOND)}
    with service_stack(tmp_path_factory.mktemp("models"), workers=workers,
                       planner_args=("--model", f"{SECOND}={MODEL}")) as stack:  # fmt: skip
        yield stack


def mixed_job(path: Path, n: int) -> tuple[Path, dict[str, str]]:
    """The shared-prefix job with every line naming a model: every third document's lines the
    second, one line a model nobody serves. Returns the file and each custom_id's model."""
    lines = shared_prefix_job(path, n, docs=6).read_text().splitlines()
    models = {}
    for i, line in enumerate(lines):
        obj = json.loads(line)
        model = SECOND if i % 6 in (0, 3) else MODEL
        obj["body"]["model"] = UNKNOWN if i == n // 2 else model
        models[obj["custom_id"]] = obj["body"]["model"]
        lines[i] = json.dumps(obj)
    path.write_text("\n".join(lines) + "\n")
    return path, models


def local_lines(job: Path, d: Path, *extra: str) -> tuple[Path, Path]:
    return local_run(job, d, *extra)


def by_custom_id(lines: list[str]) -> dict[str, str]:
    return {json.loads(line)["custom_id"]: line for line in lines}


def test_a_mixed_job_runs_each_line_on_its_models_workers_as_the_local_run_does(
    stack: ServiceStack, tmp_path: Path
) -> None:
    job_file, models = mixed_job(tmp_path / "in.jsonl", 48)
    first = local_lines(job_file, tmp_path / "first")
    second = local_lines(job_file, tmp_path / "second", "--served-model-name", SECOND)
    client = stack.client()
    job = client.submit_file(job_file)
    wait_until(lambda: client.get(job.id).state == pb.JOB_STATE_COMPLETED, 180, "the job to end")
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    client.download(job.id, out, err)
    assert client.get(job.id).request_counts == pb.RequestCounts(total=48, completed=47, failed=1)
    first_out, first_err, second_out, second_err = (
        as_job(f, job.id).splitlines() for f in (*first, *second)
    )

    expected = by_custom_id(first_out) | by_custom_id(second_out)
    got = out.read_text().splitlines()
    assert sorted(by_custom_id(got)) == sorted(c for c, m in models.items() if m != UNKNOWN)
    assert got == [expected[json.loads(line)["custom_id"]] for line in got]
    for line in got:
        assert (
            json.loads(line)["response"]["body"]["model"] == models[json.loads(line)["custom_id"]]
        )
    [unknown] = [c for c, m in models.items() if m == UNKNOWN]
    assert err.read_text().splitlines() == [by_custom_id(first_err)[unknown]]
    assert by_custom_id(first_err)[unknown] == by_custom_id(second_err)[unknown]
    assert json.loads(by_custom_id(first_err)[unknown])["error"]["code"] == "model_not_found"


def test_each_models_groups_go_to_its_own_queue_and_only_its_worker_reads_them(
    stack: ServiceStack, tmp_path: Path
) -> None:
    job_file, models = mixed_job(tmp_path / "in.jsonl", 36)
    client = stack.client()
    job = client.submit_file(job_file)
    wait_until(lambda: client.get(job.id).state == pb.JOB_STATE_COMPLETED, 180, "the job to end")
    r = stack.redis.client()
    ranges = json.loads(r.hget(JobKeys(job.id).job, "model_groups"))
    assert set(ranges) == {MODEL, SECOND}
    line_models = list(models.values())
    for model, (first, end) in ranges.items():
        assert end > first
        for gid in range(first, end):
            group = schema.GroupRecord.decode(r.hget(JobKeys(job.id).groups, str(gid)))
            assert {line_models[i] for i in group.indices} == {model}
    for model, reader in ((MODEL, "first"), (SECOND, "second")):
        consumers = r.xinfo_consumers(schema.queue_key(model), schema.CONSUMER_GROUP)
        readers = {c["name"].decode() for c in consumers} - {schema.GIVEN_BACK}
        assert readers == {reader}


@pytest.fixture
def planner(redis_server: RedisServer) -> Iterator[PlannerClient]:
    """A planner serving MODEL (its default) and SECOND, given as PREFIXGROVE_MODEL gives them."""
    models = f"{MODEL}, {SECOND}={MODEL}"
    ingest = IngestSettings(max_model_len=512)
    with planner_in_process(redis_server.url, ingest, model=models,
                            model_alias=f"{ALIAS}={SECOND}") as (_, client):  # fmt: skip
        yield client


def test_a_job_model_no_one_serves_is_refused_naming_every_served_model(
    planner: PlannerClient,
) -> None:
    with pytest.raises(PlannerError) as refused:
        planner.create_job(model=UNKNOWN)
    assert "model_not_found" in str(refused.value)
    assert repr(MODEL) in str(refused.value) and repr(SECOND) in str(refused.value)
    assert planner.list() == []


def test_lines_naming_no_model_go_to_the_jobs_model_and_each_queue_counts_its_own(
    planner: PlannerClient, redis_server: RedisServer
) -> None:
    shared = "Instructions every request of one model shares. " * 4
    lines = [
        batch_line(f"r{i}", {"prompt": f"{shared}item {i}", "max_tokens": 2}) for i in range(6)
    ]
    lines += [batch_line(f"d{i}", {"prompt": f"{shared}item {i}", "max_tokens": 2, "model": MODEL})
              for i in range(4)]  # fmt: skip
    lines.append(batch_line("x", {"prompt": "anything", "model": UNKNOWN}))
    job = planner.create_job(model=SECOND)
    planner.add_lines(job.id, [line.encode() for line in lines])
    planner.seal(job.id)
    r = redis_server.client()
    ranges = json.loads(r.hget(JobKeys(job.id).job, "model_groups"))
    groups = {
        model: [
            schema.GroupRecord.decode(r.hget(JobKeys(job.id).groups, str(g))).indices
            for g in range(first, end)
        ]
        for model, (first, end) in ranges.items()
    }
    assert list(groups) == [SECOND, MODEL]  # the job's model first
    assert sorted(i for g in groups[SECOND] for i in g) == list(range(6))
    assert sorted(i for g in groups[MODEL] for i in g) == list(range(6, 10))
    for model in (SECOND, MODEL):
        assert r.xlen(schema.queue_key(model)) == len(groups[model])
        assert planner.queue_depth(model).depth == len(groups[model])
    counts = planner.get(job.id).request_counts
    assert (counts.total, counts.failed) == (11, 1)


def test_an_alias_runs_its_lines_and_jobs_on_the_model_it_names(
    planner: PlannerClient, redis_server: RedisServer
) -> None:
    """--model-alias: a line or a job naming the alias goes to the aliased model's queue, grouped
    with that model's own lines; its queue depth is the model's."""
    shared = "Instructions every request of one model shares. " * 4
    lines = [batch_line(f"a{i}", {"prompt": f"{shared}item {i}", "max_tokens": 2, "model": ALIAS})
             for i in range(3)]  # fmt: skip
    lines += [batch_line(f"s{i}", {"prompt": f"{shared}item {i}", "max_tokens": 2, "model": SECOND})
              for i in range(3)]  # fmt: skip
    job = planner.create_job(model=ALIAS)
    assert planner.get(job.id).model == SECOND
    planner.add_lines(job.id, [line.encode() for line in lines])
    planner.seal(job.id)
    r = redis_server.client()
    ranges = json.loads(r.hget(JobKeys(job.id).job, "model_groups"))
    assert list(ranges) == [SECOND]
    first, end = ranges[SECOND]
    indices = [
        schema.GroupRecord.decode(r.hget(JobKeys(job.id).groups, str(g))).indices
        for g in range(first, end)
    ]
    assert sorted(i for g in indices for i in g) == list(range(6))
    assert planner.queue_depth(ALIAS).depth == planner.queue_depth(SECOND).depth == end - first
    assert planner.get(job.id).request_counts.failed == 0


def test_a_rebuilt_plan_sends_an_aliases_lines_to_the_model_it_names() -> None:
    """A replica that did not take every line rebuilds the plan from the records, aliases too."""
    import numpy as np

    from prefixgrove.jobs.redis_store.uploads import rebuild_plan

    class Records:
        def prompts(self, job_id: str, lines: int):  # type: ignore[no-untyped-def]
            tokens = np.arange(40, dtype=np.int32)
            yield from ((0, tokens, ALIAS), (1, tokens, SECOND), (2, tokens, None))

    plans = rebuild_plan(Records(), "j", 3, IngestSettings(), MODEL, {ALIAS: SECOND})  # type: ignore[arg-type]
    assert list(plans) == [MODEL, SECOND]  # the default model first
    assert sorted(i for u in plans[SECOND].units for i in u.indices) == [0, 1]
    assert [i for u in plans[MODEL].units for i in u.indices] == [2]
