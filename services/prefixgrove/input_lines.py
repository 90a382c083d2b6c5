"""A batch file's lines read in bounded memory, by every path an input takes (the local run, the
client's upload, the planner's HTTP batches).

A line longer than the limit is never held whole: its first `max_line_bytes + 1` bytes stand for
it, which is enough for its validation to fail it as `line_too_large`, and the rest of it is read
past in blocks. The lines after it keep their places and their answers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

_SKIP_BLOCK = 1 << 20  # read at once while passing over the rest of an over-long line
_BATCH_BYTES = 16 << 20  # at most about this much of the lines in one batch


def bounded_lines(f: BinaryIO, max_line_bytes: int) -> Iterator[bytes]:
    """The lines of `f` without their line ends; one over `max_line_bytes` comes cut to
    `max_line_bytes + 1` bytes (never blank)."""
    whole = max_line_bytes + 2  # the longest line accepted, with "\r\n"
    while line := f.readline(whole):
        if line.endswith(b"\n") or len(line) < whole:
            yield line.rstrip(b"\r\n")
            continue
        _skip_rest_of_line(f)
        cut = line[: max_line_bytes + 1]
        # NOTE: a cut line whose kept bytes are blank would pass for a blank line, which is
        # skipped, instead of failing in its place.
        yield cut if cut.strip() else cut[:-1] + b"."


def _skip_rest_of_line(f: BinaryIO) -> None:
    while (block := f.readline(_SKIP_BLOCK)) and not block.endswith(b"\n"):
        pass


def open_source(source: Path | str) -> BinaryIO:
    """A local file, or an object named by URL (s3://, gs://) streamed in bounded chunks."""
    from prefixgrove.storage.locations import is_url

    if is_url(source):
        from prefixgrove.storage.objects import open_input

        return open_input(str(source))
    return Path(source).open("rb")


def line_batches(
    path: Path | str, max_line_bytes: int, max_lines: int, max_bytes: int = _BATCH_BYTES
) -> Iterator[list[bytes]]:
    """The file's (or object's) lines (bounded_lines) in batches (batch_lines); an empty file
    gives no batch."""
    with open_source(path) as f:
        yield from batch_lines(bounded_lines(f, max_line_bytes), max_lines, max_bytes)


def batch_lines(
    lines: Iterable[bytes], max_lines: int, max_bytes: int = _BATCH_BYTES
) -> Iterator[list[bytes]]:
    """`lines` in batches of at most `max_lines` lines or about `max_bytes` bytes, whichever comes
    first; no lines give no batch."""
    batch: list[bytes] = []
    size = 0
    for line in lines:
        batch.append(line)
        size += len(line)
        if len(batch) >= max_lines or size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
