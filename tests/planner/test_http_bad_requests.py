"""What a client gets wrong in a call of the OpenAI Batch API is answered 400 with OpenAI's error
shape, never 500; `/v1/files` lists page by page. A planner in this process, a real redis-server,
raw HTTP on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from http_uploads import Answer, MultipartUpload, call
from services_testbed import RedisServer, batch_line, free_port, need_redis, planner_in_process


@pytest.fixture(scope="module")
def http_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    d = tmp_path_factory.mktemp("http-bad")
    redis = RedisServer(need_redis(), d)
    redis.start()
    port = free_port()
    try:
        with planner_in_process(redis.url, http_port=port, data_dir=str(d / "data")):
            yield port
    finally:
        redis.kill()


def refused(answer: Answer, *words: str) -> None:
    assert answer.status == 400, answer
    error = answer.body["error"]
    assert error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error["message"]


def small_file(d: Path, name: str = "in.jsonl") -> Path:
    path = d / name
    path.write_text(batch_line("r0", {"prompt": "Say it", "max_tokens": 2}) + "\n")
    return path


# --- bodies -------------------------------------------------------------------------------------
def test_an_upload_that_is_not_multipart_gets_400(http_port: int) -> None:
    answer = call(http_port, "POST", "/v1/files", b'{"purpose": "batch"}',
                  {"Content-Type": "application/json"})  # fmt: skip
    refused(answer, "multipart/form-data")


@pytest.mark.parametrize(
    "content_type, body",
    [
        ("multipart/form-data", b"--x\r\n\r\n"),  # no boundary
        ("multipart/form-data; boundary=" + "b" * 100, b"--b\r\n"),  # a boundary too long
        ("multipart/form-data; boundary=abc", b"not a part at all"),
        (
            "multipart/form-data; boundary=abc",
            b'--abc\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch',
        ),  # never closed
    ],
    ids=["no-boundary", "long-boundary", "no-parts", "unclosed-part"],
)
def test_a_malformed_multipart_upload_gets_400(
    http_port: int, content_type: str, body: bytes
) -> None:
    answer = call(http_port, "POST", "/v1/files", body, {"Content-Type": content_type})
    assert answer.status == 400, answer


def test_an_oversized_purpose_field_gets_400(http_port: int, tmp_path: Path) -> None:
    upload = MultipartUpload(small_file(tmp_path), purpose="b" * 100_000)
    refused(upload.send(http_port), "purpose")


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe", b"", b"[1, 2]"])
def test_a_batch_whose_body_is_not_a_json_object_gets_400(http_port: int, body: bytes) -> None:
    answer = call(http_port, "POST", "/v1/batches", body, {"Content-Type": "application/json"})
    refused(answer, "JSON")


# --- query strings ------------------------------------------------------------------------------
BAD_LIMITS = ["abc", "0", "-1", "1.5", "\u00b2", "9" * 5000, " 5"]


@pytest.mark.parametrize("limit", BAD_LIMITS)
@pytest.mark.parametrize("route", ["/v1/batches", "/v1/files"])
def test_a_bad_limit_gets_400_naming_what_is_accepted(
    http_port: int, route: str, limit: str
) -> None:
    refused(call(http_port, "GET", f"{route}?limit={quote(limit)}"), "limit", "whole number")


def test_a_limit_over_the_page_gets_400(http_port: int) -> None:
    refused(call(http_port, "GET", "/v1/batches?limit=101"), "1 to 100")
    refused(call(http_port, "GET", "/v1/files?limit=10001"), "1 to 10000")


# --- /v1/files pages ----------------------------------------------------------------------------
def test_files_are_listed_page_by_page_with_limit_and_after(http_port: int, tmp_path: Path) -> None:
    uploaded = {_upload(http_port, small_file(tmp_path, f"in{i}.jsonl")) for i in range(3)}
    listed = [f["id"] for f in call(http_port, "GET", "/v1/files").body["data"]]  # newest first
    assert set(listed) == uploaded
    first = call(http_port, "GET", "/v1/files?limit=2").body
    assert [f["id"] for f in first["data"]] == listed[:2] and first["has_more"] is True
    rest = call(http_port, "GET", f"/v1/files?limit=2&after={listed[1]}").body
    assert [f["id"] for f in rest["data"]] == listed[2:] and rest["has_more"] is False


def test_files_after_a_file_that_does_not_exist_get_404(http_port: int) -> None:
    answer = call(http_port, "GET", "/v1/files?after=file-000000000000000000000000")
    assert answer.status == 404 and answer.body["error"]["code"] == "not_found"


def _upload(http_port: int, path: Path) -> str:
    answer = MultipartUpload(path).send(http_port)
    assert answer.status == 200, answer
    return str(answer.body["id"])
