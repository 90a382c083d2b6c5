"""A job's two result files (output lines, error lines) written in input order as requests finish,
and picked up again after an interruption.

The rule that makes a resume safe: line i of the job reaches a file only once every line before it
has reached one, so the files always answer a prefix of the job. A kill can leave a torn last line,
and one file a flush ahead of the other; `answered_prefix` repairs both and refuses files that do
not answer this job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

# belongs(index, line, failed): could `line` of the output file (failed=False) or of the error
# file (failed=True) be the answer to the job's line `index`?
Belongs = Callable[[int, str, bool], bool]


class ResumeMismatch(ValueError):
    """The files on disk are not a prefix of this job's answers (another input's, or edited)."""


@dataclass(frozen=True)
class Answered:
    """The job's lines 0..count-1 are answered by the files' first `completed` output lines and
    first `failed` error lines."""

    count: int
    completed: int
    failed: int


class OrderedWriter:
    """Holds finished lines until every line before them is answered, then appends them to their
    file; `flush` writes what is ready and flushes both files, so a kill leaves whole lines."""

    def __init__(self, output: BinaryIO, errors: BinaryIO, start: int = 0) -> None:
        self._files = (output, errors)
        self._next = start  # the first line index not yet written
        self._held: dict[int, tuple[str, bool]] = {}
        self.written = [0, 0]  # output lines, error lines written by this writer

    @property
    def next_index(self) -> int:
        return self._next

    def put(self, index: int, line: str, failed: bool = False) -> None:
        if index < self._next or index in self._held:
            raise ValueError(f"line {index} was already answered")
        self._held[index] = (line, failed)

    def flush(self) -> None:
        while self._next in self._held:
            line, failed = self._held.pop(self._next)
            self._files[failed].write(line.encode("utf-8") + b"\n")
            self.written[failed] += 1
            self._next += 1
        for f in self._files:
            f.flush()


def answered_prefix(output: Path, errors: Path, total: int, belongs: Belongs) -> Answered:
    """Reads back what an earlier run wrote for a job of `total` lines, cuts both files to the lines
    that answer a prefix of it (a torn last line, or lines one file wrote ahead of the other), and
    says how far that prefix goes; raises ResumeMismatch when the files answer another job."""
    outs, errs = _whole_lines(output), _whole_lines(errors)
    done = completed = failed = 0
    while done < total:
        if completed < len(outs) and belongs(done, outs[completed], False):
            completed += 1
        elif failed < len(errs) and belongs(done, errs[failed], True):
            failed += 1
        else:
            break
        done += 1
    _check_ahead(output, outs[completed:], completed, done, total, belongs, False)
    _check_ahead(errors, errs[failed:], failed, done, total, belongs, True)
    _truncate(output, outs[:completed])
    _truncate(errors, errs[:failed])
    return Answered(done, completed, failed)


def _whole_lines(path: Path) -> list[str]:
    """The file's complete lines (a last line without its newline is torn, so dropped)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    # NOTE: split on b"\n" alone: a JSON line may hold U+2028 and other breaks that splitlines cuts.
    lines = data.split(b"\n")[:-1]
    try:
        return [line.decode("utf-8") for line in lines]
    except UnicodeDecodeError as exc:
        raise ResumeMismatch(f"{path} is not a job's output (not UTF-8: {exc})") from None


def _check_ahead(
    path: Path, lines: list[str], kept: int, start: int, total: int, belongs: Belongs, failed: bool
) -> None:
    """Lines past the answered prefix are only acceptable as answers to later lines, in order."""
    index = start
    for number, line in enumerate(lines, kept + 1):
        while index < total and not belongs(index, line, failed):
            index += 1
        if index == total:
            raise ResumeMismatch(
                f"{path} does not answer this input: its line {number} ({line[:80]!r}) answers "
                f"none of the input's requests from request {start + 1} on; resume only over the "
                "files of the same input, or run without --resume to overwrite them"
            )
        index += 1


def _truncate(path: Path, kept: list[str]) -> None:
    if not path.exists():
        return
    size = sum(len(line.encode("utf-8")) + 1 for line in kept)
    with path.open("r+b") as f:
        f.truncate(size)
