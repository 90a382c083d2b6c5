"""The planner client as the operator uses it, against a real planner: resuming a broken
submission, credentials, TLS."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest
from operator_testbed import MODEL, start_planner

from prefixgrove.planner.client import PlannerClient, PlannerUnavailable
from prefixgrove.settings import SecuritySettings
from prefixgrove_operator.status import job_view


def request_line(i: int) -> bytes:
    body = {"prompt": f"question {i}", "max_tokens": 1}
    return json.dumps({"custom_id": f"r{i}", "url": "/v1/completions", "body": body}).encode()


def test_a_resubmission_skips_the_lines_the_planner_already_holds(planner: PlannerClient) -> None:
    key = str(uuid.uuid4())
    lines = [request_line(i) for i in range(5)]
    first = planner.create_job(MODEL, key)
    assert planner.add_lines(first.id, lines[:2]).total == 2  # then the operator "crashes"
    again = job_view(planner.create_job(MODEL, key))
    assert (again.id, again.sealed, again.total) == (first.id, False, 2)
    assert planner.add_lines(again.id, lines, skip=again.total).total == 5
    sealed = job_view(planner.seal(again.id))
    assert (sealed.total, sealed.sealed) == (5, True)
    planner.cancel(sealed.id)


def token_client(address: str, token: str, timeout_s: float | None = None) -> PlannerClient:
    return PlannerClient(address, SecuritySettings(auth_token=token), timeout_s=timeout_s)


def test_the_planner_token_is_sent_and_a_wrong_one_is_retried_not_fatal(
    redis_url: str, logs_dir: Path
) -> None:
    server, address = start_planner(redis_url, logs_dir, token="s3cret")
    try:
        assert token_client(address, "s3cret").queue_depth().depth >= 0
        with pytest.raises(PlannerUnavailable, match="UNAUTHENTICATED"):
            token_client(address, "wrong").queue_depth()
        with pytest.raises(PlannerUnavailable, match="UNAUTHENTICATED"):
            PlannerClient(address).queue_depth()
    finally:
        server.stop()


def make_certificates(folder: Path) -> dict[str, str]:
    """A CA and a server certificate for 127.0.0.1 signed by it, made with openssl."""
    files = {name: str(folder / f"{name}.pem") for name in ("ca", "ca_key", "cert", "key", "csr")}
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for command in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
         "-keyout", files["ca_key"], "-out", files["ca"]],
        ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
         "-keyout", files["key"], "-out", files["csr"]],
        ["x509", "-req", "-in", files["csr"], "-CA", files["ca"], "-CAkey", files["ca_key"],
         "-CAcreateserial", "-days", "1", "-extfile", str(folder / "san.ext"), "-out", files["cert"]],
    ):  # fmt: skip
        subprocess.run(["openssl", *command], check=True, capture_output=True)
    return files


def test_the_planner_is_reached_over_tls_with_its_ca(
    redis_url: str, logs_dir: Path, tmp_path: Path
) -> None:
    files = make_certificates(tmp_path)
    server, address = start_planner(redis_url, logs_dir, token="t", tls=files)
    try:
        security = SecuritySettings(auth_token="t", tls_ca=files["ca"])
        assert PlannerClient(address, security).queue_depth().depth >= 0
        with pytest.raises(PlannerUnavailable):
            token_client(address, "t", timeout_s=2.0).queue_depth()  # plaintext
    finally:
        server.stop()
