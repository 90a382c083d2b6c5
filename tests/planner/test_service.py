"""The Planner service over real gRPC on loopback, with a real redis-server behind it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
from planner_on_loopback import batch_file, code_of, lines, rejection, start
from run_tags import as_job
from services_testbed import MODEL, RedisServer, batch_line

from prefixgrove.jobs.redis_store.schema import JobKeys
from prefixgrove.planner.client import PlannerClient
from prefixgrove.planner.server import build_server
from prefixgrove.settings import IngestSettings, PlannerSettings, SecuritySettings
from prefixgrove_proto import planner_pb2 as pb


def test_job_lifecycle_until_queued(client: PlannerClient) -> None:
    job = client.create_job(metadata={"team": "eval"})
    assert job.state == pb.JOB_STATE_VALIDATING and job.model == MODEL
    reply = client.add_lines(job.id, [*lines(10), b"{broken"])
    assert (reply.accepted, reply.rejected, reply.total) == (10, 1, 11)
    sealed = client.seal(job.id)
    assert sealed.state == pb.JOB_STATE_IN_PROGRESS
    assert sealed.request_counts == pb.RequestCounts(total=11, completed=0, failed=1)
    assert sealed.groups_total >= 1 and sealed.queue.depth == sealed.groups_total
    assert sealed.prefix_tokens_saved > 0 and sealed.metadata["team"] == "eval"
    assert client.queue_depth(MODEL).depth == sealed.groups_total
    assert [j.id for j in client.list()] == [job.id]


def test_invalid_lines_are_streamed_as_errors_in_input_order(client: PlannerClient) -> None:
    job = client.create_job()
    client.add_lines(job.id, [b"nope", *lines(2), batch_line("r0", {"prompt": "dup"}).encode()])
    client.seal(job.id)
    # Without workers the stream stops at the first request not answered yet...
    assert [e.index for e in client.results(job.id, 0, pb.RESULT_KIND_ALL)] == [0]
    # ...and once the job has ended, requests never answered are passed over.
    client.cancel(job.id)
    errors = list(client.results(job.id, 0, pb.RESULT_KIND_ERROR))
    assert [(e.index, json.loads(e.line)["error"]["code"]) for e in errors] == [
        (0, "invalid_json"),
        (3, "duplicate_custom_id"),
    ]
    assert [e.index for e in client.results(job.id, 1, pb.RESULT_KIND_ERROR)] == [3]  # resumed


def test_idempotency_key_gives_back_the_same_job(client: PlannerClient) -> None:
    first = client.create_job(idempotency_key="batchjob-uid-1")
    second = client.create_job(idempotency_key="batchjob-uid-1")
    assert second.id == first.id and client.create_job().id != first.id


def test_unknown_job_is_not_found(client: PlannerClient) -> None:
    assert code_of(lambda: client.get("job_missing")) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: client.add_lines("job_missing", lines(1))) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: list(client.results("job_missing"))) == grpc.StatusCode.NOT_FOUND


def test_adding_to_a_sealed_job_is_a_failed_precondition(client: PlannerClient) -> None:
    job = client.create_job()
    client.add_lines(job.id, lines(2))
    client.seal(job.id)
    assert (
        code_of(lambda: client.add_lines(job.id, lines(1))) == grpc.StatusCode.FAILED_PRECONDITION
    )


def test_empty_file_fails_the_job(client: PlannerClient) -> None:
    job = client.create_job()
    client.add_lines(job.id, [])
    assert code_of(lambda: client.seal(job.id)) == grpc.StatusCode.FAILED_PRECONDITION
    failed = client.get(job.id)
    assert failed.state == pb.JOB_STATE_FAILED and failed.error.code == "empty_file"


def test_non_jsonl_file_fails_the_job(client: PlannerClient) -> None:
    job = client.create_job()
    client.add_lines(job.id, [b"a,b,c", b"1,2,3"])
    assert code_of(lambda: client.seal(job.id)) == grpc.StatusCode.INVALID_ARGUMENT
    assert client.get(job.id).error.code == "invalid_file"


def test_a_model_no_worker_serves_is_refused_with_model_not_found(client: PlannerClient) -> None:
    refused = rejection(lambda: client.create_job(model="llama-3.1-8b-random"))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "model_not_found" in str(refused) and repr(MODEL) in str(refused)
    assert client.list() == []  # no job was created to sit in_progress


def test_refusing_a_model_path_says_nothing_of_the_planners_disk(
    client: PlannerClient, tmp_path: Path
) -> None:
    (tmp_path / "private-weights.gguf").write_bytes(b"GGUF")
    for model in (str(tmp_path), str(tmp_path / "private-weights.gguf"), "/no/such/model"):
        message = str(rejection(lambda model=model: client.create_job(model=model)))
        assert "model_not_found" in message
        assert "private" not in message.replace(model, "")
        assert "exist" not in message and "No such file" not in message


def test_cancel_before_any_worker_cancels_at_once(client: PlannerClient) -> None:
    job = client.create_job()
    client.add_lines(job.id, lines(3))
    client.seal(job.id)
    assert client.cancel(job.id).state == pb.JOB_STATE_CANCELLED
    assert code_of(lambda: client.cancel(job.id)) == grpc.StatusCode.FAILED_PRECONDITION
    assert list(client.watch(job.id))[-1].state == pb.JOB_STATE_CANCELLED


def test_health_and_reflection_are_served(client: PlannerClient) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    health = health_pb2_grpc.HealthStub(client.channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service="prefixgrove.v1.Planner"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    [answer] = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for s in answer.list_services_response.service}
    assert "prefixgrove.v1.Planner" in names


def test_a_job_whose_input_failed_frees_its_idempotency_key(client: PlannerClient) -> None:
    job = client.create_job(idempotency_key="upload-1")
    client.add_lines(job.id, [])
    code_of(lambda: client.seal(job.id))  # empty_file
    retry = client.create_job(idempotency_key="upload-1")
    assert retry.id != job.id and retry.state == pb.JOB_STATE_VALIDATING


def test_an_upload_abandoned_before_its_seal_expires_and_frees_its_key(
    redis_server: RedisServer,
) -> None:
    server, port = start(redis_server)
    client = PlannerClient(f"127.0.0.1:{port}")
    try:
        job = client.create_job(idempotency_key="upload-2")
        client.add_lines(job.id, lines(3))  # and then the client goes away, never sealing
        service = server.service
        assert service.expire_idle_uploads(900.0) == []  # not idle yet
        assert service.expire_idle_uploads(900.0, now=time.time() + 901) == [job.id]
        failed = client.get(job.id)
        assert (failed.state, failed.error.code) == (pb.JOB_STATE_FAILED, "upload_abandoned")
        assert redis_server.client().exists(JobKeys(job.id).requests) == 0  # its lines are gone
        assert client.seal(job.id).state == pb.JOB_STATE_FAILED  # a late seal changes nothing
        assert client.create_job(idempotency_key="upload-2").id != job.id
    finally:
        client.close()
        server.stop(0)


def test_lists_come_in_pages_that_cover_every_job_once(client: PlannerClient) -> None:
    made = [client.create_job().id for _ in range(5)]
    first = client._call("ListJobs", pb.ListJobsRequest(limit=2))
    assert len(first.jobs) == 2 and first.next_page_token
    assert [j.id for j in client.list(100)] == made[::-1]  # newest first, each once
    assert [j.id for j in client.list(3)] == made[:1:-1]


def test_oversized_metadata_is_refused_by_its_size(client: PlannerClient) -> None:
    assert code_of(lambda: client.create_job(metadata={"blob": "x" * (1 << 20)})) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert client.create_job(metadata={"team": "evals", "run": "2026-11"}).metadata["team"] == (
        "evals"
    )


def test_a_line_over_any_message_limit_fails_alone(client: PlannerClient, tmp_path: Path) -> None:
    huge = batch_line("huge", {"prompt": "x" * (70 << 20), "max_tokens": 2}).encode()
    job = client.submit_file(batch_file(tmp_path / "in.jsonl", [*lines(2), huge]))
    assert job.state != pb.JOB_STATE_FAILED
    client.cancel(job.id)  # no worker here: results stream in input order once the job has ended
    [error] = list(client.results(job.id, 0, pb.RESULT_KIND_ERROR))
    assert error.index == 2
    assert json.loads(error.line)["error"]["code"] == "line_too_large"


def test_lines_parsed_in_worker_processes_make_the_same_job(redis_server: RedisServer) -> None:
    """A planner parsing uploads in two processes plans and refuses exactly what one that parses
    in its own does: the same groups, the same error lines at the same indices."""
    mixed = lines(150)
    mixed[10:10] = [b"nope", b"[" * 500, batch_line("r3", {"prompt": "dup"}).encode(), b"{}"]
    mixed += [
        batch_line(f"t{i}", {"prompt": [1, 2, i], "max_tokens": 2}).encode() for i in range(80)
    ]
    jobs = []
    for processes in (1, 2):
        planner = PlannerSettings(redis_url=redis_server.url, host="127.0.0.1", port=0,
                                  model=MODEL, parse_processes=processes)  # fmt: skip
        server = build_server(planner, IngestSettings(max_model_len=512), SecuritySettings())
        client = PlannerClient(f"127.0.0.1:{server.port}")
        job = client.create_job()
        client.add_lines(job.id, mixed)
        sealed = client.seal(job.id)
        client.cancel(job.id)
        # each job tags its ids with its own run tag: compared under one job's tag
        errors = [
            (e.index, as_job(e.line, "one-job"))
            for e in client.results(job.id, 0, pb.RESULT_KIND_ERROR)
        ]
        jobs.append((sealed.request_counts.total, sealed.groups_total, sealed.prefix_tokens_saved,
                     sealed.prompt_tokens, errors))  # fmt: skip
        client.close()
        server.stop(0)
    assert jobs[0] == jobs[1]
    assert [index for index, _ in jobs[0][4]] == [10, 11, 12, 13]


def test_results_stream_in_windows_of_a_few_megabytes_whatever_their_lines() -> None:
    """A stream holds one window of results: few lines when they are large (logprobs), many when
    they are small; benchmarks/planner.py --mode http measures the planner's memory for it."""
    from prefixgrove.jobs.redis_store.schema import ResultRecord
    from prefixgrove.planner.results import _RESULT_WINDOW, _RESULT_WINDOW_BYTES, _next_window

    def lines(size: int, n: int) -> list[ResultRecord | None]:
        return [ResultRecord(False, "x" * size) for _ in range(n)]

    assert _next_window(lines(256 << 10, 16)) * (256 << 10) <= _RESULT_WINDOW_BYTES
    assert _next_window(lines(256 << 10, 16)) >= 1
    assert _next_window(lines(64 << 20, 1)) == 1
    assert _next_window(lines(300, 512)) == _RESULT_WINDOW
    assert _next_window([None] * 16) == _RESULT_WINDOW  # nothing answered yet: read on
