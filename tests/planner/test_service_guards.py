"""The Planner service's guards, over real gRPC on loopback: a bearer token and mutual TLS where
they are set, loopback unless told otherwise, an upload failed only by its own planner's stop, a
download marker of another job and a link planted beside an output refused, and watches beyond
the stream limit refused while short calls still answer."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from planner_on_loopback import batch_file, code_of, lines, start
from polling import wait_for
from services_testbed import MODEL, RedisServer
from tls_certs import mutual_tls

from prefixgrove.planner.client import PlannerClient, PlannerError
from prefixgrove.planner.server import build_server
from prefixgrove.settings import IngestSettings, PlannerSettings, SecuritySettings
from prefixgrove_proto import planner_pb2 as pb


def test_bearer_token_is_required(redis_server: RedisServer) -> None:
    server, port = start(redis_server, SecuritySettings(auth_token="t0ken"))
    try:
        anonymous = PlannerClient(f"127.0.0.1:{port}")
        assert code_of(lambda: anonymous.list()) == grpc.StatusCode.UNAUTHENTICATED
        assert (
            code_of(lambda: anonymous.add_lines("x", lines(1))) == grpc.StatusCode.UNAUTHENTICATED
        )
        wrong = PlannerClient(f"127.0.0.1:{port}", SecuritySettings(auth_token="guess"))
        assert code_of(lambda: wrong.list()) == grpc.StatusCode.UNAUTHENTICATED
        assert PlannerClient(f"127.0.0.1:{port}", SecuritySettings(auth_token="t0ken")).list() == []
    finally:
        server.stop(0)


def test_mutual_tls_refuses_clients_without_a_certificate(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    server, port = start(redis_server, mutual_tls(tmp_path))
    p = str(tmp_path)
    target = f"127.0.0.1:{port}"
    try:
        plaintext = PlannerClient(target)
        assert code_of(lambda: plaintext.list()) == grpc.StatusCode.UNAVAILABLE
        no_cert = PlannerClient(target, SecuritySettings(tls_ca=f"{p}/ca.pem"))
        assert code_of(lambda: no_cert.list()) == grpc.StatusCode.UNAVAILABLE
        good = PlannerClient(target, SecuritySettings(tls_ca=f"{p}/ca.pem", tls_client_cert=f"{p}/client.pem",
                                                      tls_client_key=f"{p}/client.key"))  # fmt: skip
        assert good.list() == []
    finally:
        server.stop(0)


def test_a_job_is_failed_only_when_its_own_planner_stopped_during_the_upload(
    redis_server: RedisServer,
) -> None:
    planner = PlannerSettings(redis_url=redis_server.url, host="127.0.0.1", port=0, model=MODEL)
    server_a, server_b = [
        build_server(planner, IngestSettings(), SecuritySettings()) for _ in range(2)
    ]
    a, b = server_a.service, server_b.service
    try:
        client = PlannerClient(f"127.0.0.1:{server_a.port}")
        job = client.create_job()
        client.add_lines(job.id, lines(2))
        b.recover()  # a rolling update: the other planner is alive and keeps its upload
        assert client.get(job.id).state == pb.JOB_STATE_VALIDATING
        redis_server.client().delete(f"pg:planner:{a.instance}")  # its heartbeat ran out
        b.recover()
        failed = client.get(job.id)
        assert failed.state == pb.JOB_STATE_FAILED and failed.error.code == "ingest_interrupted"
    finally:
        server_a.stop(0)
        server_b.stop(0)


def test_planner_listens_on_loopback_unless_told_otherwise() -> None:
    assert PlannerSettings().host == "127.0.0.1"


def test_serving_a_non_loopback_address_without_a_token_is_warned_about(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    for host, token, warned in (("0.0.0.0", None, True), ("0.0.0.0", "s3cret", False),
                                ("127.0.0.1", None, False)):  # fmt: skip
        caplog.clear()
        planner = PlannerSettings(redis_url=redis_server.url, host=host, port=0, model=MODEL)
        server = build_server(planner, IngestSettings(), SecuritySettings(auth_token=token))
        server.stop(0)
        said = any("without a bearer token" in r.getMessage() for r in caplog.records)
        assert said == warned, (host, token)


def test_a_download_marker_of_another_job_is_refused(client: PlannerClient, tmp_path: Path) -> None:
    job = client.submit_file(batch_file(tmp_path / "in.jsonl", lines(2)))
    out, err = tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
    out.write_text('{"custom_id": "from job A"}\n')
    err.write_text("")
    (tmp_path / "out.jsonl.offset").write_text("job-a 1 28 0")
    with pytest.raises(
        ValueError, match=f"belongs to an interrupted download of job job-a, not {job.id}"
    ):
        client.download(job.id, out, err)
    assert out.read_text() == '{"custom_id": "from job A"}\n'


def test_written_results_never_follow_a_link_planted_beside_the_output(
    client: PlannerClient, tmp_path: Path
) -> None:
    job = client.submit_file(batch_file(tmp_path / "in.jsonl", [*lines(1), b"not json"]))
    client.cancel(job.id)  # ended: its error line can be written out
    victim = tmp_path / "elsewhere.txt"
    victim.write_text("untouched\n")
    out_dir = tmp_path / "volume"
    out_dir.mkdir()
    for name in ("out.jsonl.partial", "out.errors.jsonl.partial", "out.jsonl"):
        (out_dir / name).symlink_to(victim)
    outputs, errors = client.write_results(
        job.id, out_dir / "out.jsonl", out_dir / "out.errors.jsonl"
    )
    assert victim.read_text() == "untouched\n"
    for path, count in ((out_dir / "out.jsonl", outputs), (out_dir / "out.errors.jsonl", errors)):
        assert not path.is_symlink()
        assert len(path.read_text().splitlines()) == count
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "out.errors.jsonl",
        "out.errors.jsonl.partial",
        "out.jsonl",
        "out.jsonl.partial",
    ]  # the planted links stay, unused; no temporary file is left behind


def test_watches_beyond_the_stream_limit_are_refused_and_short_calls_still_answer(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    planner = PlannerSettings(
        redis_url=redis_server.url, host="127.0.0.1", port=0, model=MODEL, max_streams=2
    )
    server = build_server(planner, IngestSettings(max_model_len=512), SecuritySettings())
    clients = [PlannerClient(f"127.0.0.1:{server.port}") for _ in range(4)]
    try:
        job = clients[0].submit_file(
            batch_file(tmp_path / "in.jsonl", lines(2))
        )  # no worker: runs on
        watches = [c.watch(job.id) for c in clients[:2]]
        for w in watches:
            next(w)  # each holds its stream open now
        with pytest.raises(PlannerError) as refused:
            next(clients[2].watch(job.id))
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-streams" in str(refused.value)
        assert clients[3].get(job.id).id == job.id  # a short call still has a thread
        watches[0].close()  # a closed watch gives its slot back
        wait_for("a freed stream slot", lambda: _watch_opens(clients[2], job.id), timeout=30)
    finally:
        for c in clients:
            c.close()
        server.stop(0)


def _watch_opens(client: PlannerClient, job_id: str) -> bool:
    try:
        stream = client.watch(job_id)
        next(stream)
        stream.close()
        return True
    except PlannerError:
        return False
