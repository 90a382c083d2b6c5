"""The OpenAI Batch API the planner serves over HTTP, driven by the official `openai` SDK against
real redis-server, planner and worker processes: a script written for OpenAI's Batch API runs
against prefixgrove with only `base_url` and `api_key` changed."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from openai import OpenAI
from openai.types import Batch
from run_tags import as_job
from services_testbed import (
    MODEL,
    RedisServer,
    ServiceStack,
    batch_line,
    free_port,
    local_run,
    planner_in_process,
    service_stack,
    shared_prefix_job,
    wait_for_port,
    wait_until,
)
from tls_certs import mutual_tls

TOKEN = "http-api-test-token"


@dataclass
class Stack:
    services: ServiceStack
    http_port: int

    def client(self, token: str = TOKEN) -> OpenAI:
        base_url = f"http://127.0.0.1:{self.http_port}/v1"
        return OpenAI(base_url=base_url, api_key=token, max_retries=0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    d = tmp_path_factory.mktemp("http")
    http_port = free_port()
    planner_args = ("--http-port", str(http_port), "--auth-token", TOKEN, "--data-dir",
                    str(d / "data"), "--parse-processes", "1")  # fmt: skip
    with service_stack(d, workers={"w1": ()}, planner_args=planner_args) as services:
        wait_for_port(http_port, services.planner)
        yield Stack(services, http_port)


def upload(client: OpenAI, path: Path) -> str:
    with path.open("rb") as f:
        return client.files.create(file=f, purpose="batch").id


def create_batch(client: OpenAI, path: Path, **metadata: str) -> Batch:
    return client.batches.create(input_file_id=upload(client, path), completion_window="24h",
                                 endpoint="/v1/completions", metadata=metadata or None)  # fmt: skip


def wait_for_end(client: OpenAI, batch_id: str, timeout: float = 240) -> Batch:
    ended = ("completed", "failed", "cancelled", "expired")
    wait_until(lambda: client.batches.retrieve(batch_id).status in ended, timeout,
               f"batch {batch_id} to end")  # fmt: skip
    return client.batches.retrieve(batch_id)


def small_job(path: Path, n: int) -> Path:
    lines = [batch_line(f"r{i}", {"prompt": f"Say {i}", "max_tokens": 2}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_batch_through_the_sdk_equals_the_local_run(stack: Stack, tmp_path: Path) -> None:
    job_file = shared_prefix_job(tmp_path / "in.jsonl", 60, with_errors=True)
    local_out, local_err = local_run(job_file, tmp_path)
    client = stack.client()
    batch = create_batch(client, job_file, team="search")
    assert batch.status in ("validating", "in_progress")
    assert batch.metadata == {"team": "search"}
    done = wait_for_end(client, batch.id)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.failed) == (63, 4)
    assert done.in_progress_at and done.completed_at and done.completed_at >= done.created_at
    assert done.model == MODEL and done.usage is not None
    assert done.usage.input_tokens > done.usage.input_tokens_details.cached_tokens > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens > 0
    assert done.output_file_id and done.error_file_id
    output = client.files.content(done.output_file_id).content
    assert output.decode() == as_job(local_out, batch.id)  # a batch is the job of its id
    assert client.files.content(done.error_file_id).content.decode() == as_job(local_err, batch.id)
    assert client.files.retrieve(done.output_file_id).bytes == len(output)


def test_an_uploaded_file_is_listed_read_and_deleted(stack: Stack, tmp_path: Path) -> None:
    client = stack.client()
    path = small_job(tmp_path / "in.jsonl", 3)
    file_id = upload(client, path)
    info = client.files.retrieve(file_id)
    assert (info.bytes, info.purpose, info.filename) == (path.stat().st_size, "batch", "in.jsonl")
    assert file_id in [f.id for f in client.files.list(purpose="batch").data]
    assert client.files.content(file_id).content == path.read_bytes()
    assert client.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)
    assert file_id not in [f.id for f in client.files.list().data]


def test_an_upload_of_another_purpose_is_refused(stack: Stack, tmp_path: Path) -> None:
    path = small_job(tmp_path / "in.jsonl", 1)
    with path.open("rb") as f, pytest.raises(openai.BadRequestError, match="purpose"):
        stack.client().files.create(file=f, purpose="fine-tune")


def test_a_cancelled_batch_keeps_the_answers_it_had(stack: Stack, tmp_path: Path) -> None:
    client = stack.client()
    job_file = shared_prefix_job(tmp_path / "in.jsonl", 120, max_tokens=24, docs=8)
    batch = create_batch(client, job_file)

    def some_answered() -> bool:
        counts = client.batches.retrieve(batch.id).request_counts
        return counts is not None and counts.completed > 0

    wait_until(some_answered, 240, "the batch's first answers")
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_for_end(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    assert done.request_counts is not None
    assert 0 < done.request_counts.completed < 120
    assert done.output_file_id
    lines = client.files.content(done.output_file_id).content.splitlines()
    assert len(lines) == done.request_counts.completed


def test_an_empty_input_fails_the_batch_with_its_error(stack: Stack, tmp_path: Path) -> None:
    client = stack.client()
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    done = wait_for_end(client, create_batch(client, empty).id, timeout=60)
    assert done.status == "failed" and done.failed_at
    assert done.errors is not None and done.errors.data
    assert done.errors.data[0].code == "empty_file"
    assert done.output_file_id is None


def test_an_unserved_endpoint_is_refused_and_embeddings_are_served(
    stack: Stack, tmp_path: Path
) -> None:
    client = stack.client()
    file_id = upload(client, small_job(tmp_path / "in.jsonl", 1))
    with pytest.raises(openai.BadRequestError, match="/v1/moderations"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/moderations",  # type: ignore[arg-type]
                              completion_window="24h")  # fmt: skip
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings",
                                  completion_window="24h")  # fmt: skip
    assert batch.endpoint == "/v1/embeddings"
    assert wait_for_end(client, batch.id).status == "completed"


def test_batches_list_newest_first_page_by_page(stack: Stack, tmp_path: Path) -> None:
    client = stack.client()
    path = small_job(tmp_path / "in.jsonl", 1)
    created = [create_batch(client, path).id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == created[::-1][:2]
    assert first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == created[0]
    for batch_id in created:
        wait_for_end(client, batch_id)


def test_a_wrong_token_is_refused_with_401(stack: Stack) -> None:
    with pytest.raises(openai.AuthenticationError) as refused:
        stack.client(token="not-the-token").batches.list()
    assert refused.value.status_code == 401


def test_a_call_without_a_token_gets_openais_error_shape(stack: Stack) -> None:
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/v1/files", timeout=10)
    assert refused.value.code == 401
    error = json.loads(refused.value.read())["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"


def test_a_5mb_upload_streams_to_disk(stack: Stack, tmp_path: Path) -> None:
    """The planner's peak memory, reset just before, grows by far less than the file."""
    line = batch_line("x" * 8, {"prompt": "y" * 1000, "max_tokens": 1})
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join([line] * (5_000_000 // len(line) + 1)) + "\n")
    pid = stack.services.planner.proc.pid
    status = Path(f"/proc/{pid}/status")
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # peak := current
    before = _kib(status, "VmHWM")
    file_id = upload(stack.client(), big)
    grown = (_kib(status, "VmHWM") - before) * 1024
    assert stack.client().files.retrieve(file_id).bytes == big.stat().st_size
    assert grown < big.stat().st_size / 2, f"the planner's peak grew by {grown} bytes"


def _kib(status: Path, field: str) -> int:
    for row in status.read_text().splitlines():
        if row.startswith(field + ":"):
            return int(row.split()[1])
    raise AssertionError(f"{status} has no {field}")


def test_the_http_api_takes_the_planners_mutual_tls(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    security = mutual_tls(tmp_path)
    p = str(tmp_path)
    http_port = free_port()
    url = f"https://127.0.0.1:{http_port}/v1/files"
    trusting = ssl.create_default_context(cafile=f"{p}/ca.pem")
    with planner_in_process(redis_server.url, security=security, http_port=http_port,
                            data_dir=str(tmp_path / "data")):  # fmt: skip
        # no client certificate: refused in the handshake (TLS 1.3: at the first read)
        with pytest.raises(OSError):
            urllib.request.urlopen(url, context=trusting, timeout=10)
        trusting.load_cert_chain(f"{p}/client.pem", f"{p}/client.key")
        with urllib.request.urlopen(url, context=trusting, timeout=10) as answer:
            assert json.loads(answer.read()) == {"object": "list", "data": [], "has_more": False}
