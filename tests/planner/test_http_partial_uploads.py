"""An upload's partial file is reclaimed when a planner starts, if the planner writing it stopped;
one that another planner (sharing the folder) is still writing is left alone. Planner processes,
killed with SIGKILL, on a real redis-server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from http_uploads import Answer, MultipartUpload
from services_testbed import (
    Process,
    ServiceStack,
    free_port,
    service_stack,
    start_planner,
    wait_for_port,
    wait_until,
)

_FILE_BYTES = 8 << 20
_SENT_BEFORE_PAUSE = 1 << 20


def partials(data: Path) -> list[Path]:
    return sorted((data / "prefixgrove-files").glob(".file-*.partial"))


@contextmanager
def paused_upload(tmp_path: Path, http_port: int) -> Iterator[tuple[MultipartUpload, list]]:
    """An upload that sends part of its file and waits; the partial file is on disk when this
    yields. Leaving lets the upload go on; its answer (or error) is in the yielded list."""
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\n" * _FILE_BYTES)
    upload = MultipartUpload(source, pause_after=_SENT_BEFORE_PAUSE)
    outcome: list[Answer | Exception] = []

    def send() -> None:
        try:
            outcome.append(upload.send(http_port))
        except Exception as exc:  # the planner was killed under it
            outcome.append(exc)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    data = tmp_path / "data"
    wait_until(lambda: any(p.stat().st_size > 0 for p in partials(data)), 60, "a partial file")
    try:
        yield upload, outcome
    finally:
        upload.resume.set()
        thread.join(60)


def http_stack(tmp_path: Path, http_port: int) -> AbstractContextManager[ServiceStack]:
    args = ("--http-port", str(http_port), "--data-dir", str(tmp_path / "data"))
    return service_stack(tmp_path, planner_args=args)


def test_a_partial_file_of_a_killed_planner_is_reclaimed_when_a_planner_starts(
    tmp_path: Path,
) -> None:
    http_port = free_port()
    with http_stack(tmp_path, http_port) as stack:
        wait_for_port(http_port, stack.planner)
        with paused_upload(tmp_path, http_port):
            stack.planner.kill()
            stack.planner.wait(30)
        assert partials(tmp_path / "data"), "the killed planner left its partial file"
        stack.start_planner()
        wait_for_port(http_port, stack.planner)
        assert partials(tmp_path / "data") == []


def test_a_partial_file_another_planner_writes_is_left_alone(tmp_path: Path) -> None:
    http_port = free_port()
    with http_stack(tmp_path, http_port) as stack:
        wait_for_port(http_port, stack.planner)
        with paused_upload(tmp_path, http_port) as (_, outcome):
            [writing] = partials(tmp_path / "data")
            other = _second_planner(stack, tmp_path)
            try:
                assert partials(tmp_path / "data") == [writing]
            finally:
                other.stop()
        [answer] = outcome
        assert isinstance(answer, Answer) and answer.status == 200, answer
        assert (tmp_path / "data" / "prefixgrove-files" / answer.body["id"]).stat().st_size == (
            _FILE_BYTES
        )


def _second_planner(stack: ServiceStack, tmp_path: Path) -> Process:
    """A planner sharing the first one's folder of files, once its HTTP API listens."""
    http_port = free_port()
    args = ("--http-port", str(http_port), "--data-dir", str(tmp_path / "data"))
    planner = start_planner(stack.redis.url, free_port(), tmp_path / "second.log", *args)
    wait_for_port(http_port, planner)
    return planner
