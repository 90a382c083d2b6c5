"""A BatchJob's results written to the shared volume as they arrive, so a job cancelled, stopped or
deleted half-way leaves every answer it got.

Each call appends the lines answered since the last one, in input order: a round of a job still
running writes up to the first request not answered yet. The last call, once the planner job is
final, writes every line left, the requests never answered included: the planner sends each as an
error line (code `cancelled` or `not_run`), so the output and errors files together name every
request. A marker beside the output, `.<output name>.written`, holds `<job id> <next input index>
<output size> <errors size> <outputs> <errors>`: a call interrupted between writing and updating the
marker truncates the files back to the sizes it names, so no line is written twice. The marker of
another job (a re-created BatchJob with the same output path) is ignored and both files start over.
The last call removes the marker; a last call made again writes both files over, with the same lines.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from prefixgrove.planner.client import PlannerClient
from prefixgrove_proto import planner_pb2 as pb


@dataclass(frozen=True)
class Progress:
    """Where the written files stand: the next input index and what the files hold."""

    next_index: int = 0
    output_size: int = 0
    errors_size: int = 0
    outputs: int = 0
    errors: int = 0


@dataclass(frozen=True)
class Failure:
    """A failed request as people find it in their input: its 1-based request line."""

    line: int
    custom_id: str
    code: str
    message: str

    def __str__(self) -> str:
        named = f" (custom_id {self.custom_id!r})" if self.custom_id else ""
        return f"request line {self.line}{named}: {self.code}: {self.message}"


# codes of the error lines the planner sends for requests a finished job never answered
UNANSWERED_CODES = frozenset({"cancelled", "not_run"})
# NOTE: the status timer and the deletion handler may write one job's files at once; writers of one
# output path take the same lock (a fixed set of them: memory stays bounded however many jobs ran)
_LOCKS = tuple(threading.Lock() for _ in range(64))


def marker_path(output: Path) -> Path:
    return output.with_name(f".{output.name}.written")


def lock_for(output: str) -> threading.Lock:
    """The lock the writers of one output (a path or a URL) take."""
    return _LOCKS[zlib.crc32(output.encode()) % len(_LOCKS)]


def append_new_results(
    planner: PlannerClient, job_id: str, output: Path, errors: Path, finished: bool
) -> tuple[Progress, Failure | None]:
    """Appends the results answered since the last call; returns where the files stand and the
    first failed request among the new lines. `finished`: the planner job is final (completed,
    failed or cancelled), so this call writes every line left and removes the marker."""
    output.parent.mkdir(parents=True, exist_ok=True)
    errors.parent.mkdir(parents=True, exist_ok=True)
    with lock_for(str(output)):
        marker = marker_path(output)
        start = _read_marker(marker, job_id)
        if not _files_hold(start, output, errors):
            start = Progress()  # a file cut short since the marker: both start over, never padded
        with _open_at(output, start.output_size) as out, _open_at(errors, start.errors_size) as err:
            progress, first_failure = copy_results(planner, job_id, start, out, err)
        if finished:
            marker.unlink(missing_ok=True)
        else:
            _write_marker(marker, job_id, progress)
    return progress, first_failure


class Writer(Protocol):
    def write(self, data: bytes, /) -> int: ...


def copy_results(
    planner: PlannerClient, job_id: str, start: Progress, out: Writer, err: Writer
) -> tuple[Progress, Failure | None]:
    """Writes the result lines from `start` on (every line left, the unanswered ones too, of a
    final job) to `out` and `err`; returns where they stand and the first failed request."""
    first_failure: Failure | None = None
    counts = [start.outputs, start.errors]
    sizes = [start.output_size, start.errors_size]
    index = start.next_index
    lines = planner.results(job_id, start.next_index, pb.RESULT_KIND_ALL, unanswered=True)
    for result in lines:
        data = result.line.encode() + b"\n"
        (err if result.is_error else out).write(data)
        counts[result.is_error] += 1
        sizes[result.is_error] += len(data)
        index = result.index + 1
        if result.is_error and first_failure is None:
            failure = failure_of(result.index, result.line)
            first_failure = None if failure.code in UNANSWERED_CODES else failure
    return Progress(index, sizes[0], sizes[1], counts[0], counts[1]), first_failure


def failure_of(index: int, line: str) -> Failure:
    """The failure an error line reports; `index` is its 0-based position in the job's input."""
    try:
        record = json.loads(line)
    except ValueError:
        record = {}
    error = record.get("error") if isinstance(record, dict) else None
    error = error if isinstance(error, dict) else {}
    return Failure(
        line=index + 1,
        custom_id=str(record.get("custom_id") or "") if isinstance(record, dict) else "",
        code=str(error.get("code") or "error"),
        message=str(error.get("message") or line),
    )


def _open_at(path: Path, size: int) -> IO[bytes]:
    """`path` for appending after its first `size` bytes. NOTE: O_NOFOLLOW, so a link planted at
    the output path is refused (OSError) instead of written through."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    handle = os.fdopen(fd, "wb")
    handle.truncate(size)
    handle.seek(size)
    return handle


def _files_hold(at: Progress, output: Path, errors: Path) -> bool:
    """Whether both files still hold at least the bytes the marker says were written."""
    return all(
        (path.stat().st_size if path.exists() else 0) >= size
        for path, size in ((output, at.output_size), (errors, at.errors_size))
    )


def _read_marker(marker: Path, job_id: str) -> Progress:
    try:
        return parse_marker(marker.read_text(), job_id)
    except FileNotFoundError:
        return Progress()


def parse_marker(text: str, job_id: str) -> Progress:
    fields = text.split()
    if len(fields) != 6 or fields[0] != job_id or not all(f.isdigit() for f in fields[1:]):
        return Progress()  # another job's, or damaged: start both files over
    return Progress(*(int(f) for f in fields[1:]))


def marker_text(job_id: str, at: Progress) -> str:
    return f"{job_id} {at.next_index} {at.output_size} {at.errors_size} {at.outputs} {at.errors}"


def _write_marker(marker: Path, job_id: str, at: Progress) -> None:
    partial = marker.with_name(marker.name + ".partial")
    partial.write_text(marker_text(job_id, at))
    os.replace(partial, marker)
