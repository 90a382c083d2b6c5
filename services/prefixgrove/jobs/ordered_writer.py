"""A job's two result files (output lines, error lines) written in input order as requests finish,
and picked up again after an interruption.

The rule that makes a resume safe: line i of the job reaches a file only once every line before it
has reached one, so the files always answer a prefix of the job. A kill can leave a torn last line,
and one file a flush ahead of the other; `read_back` cuts both back to whole lines of that prefix
and refuses files that do not answer this job. Within the prefix, an answer whose request changed
since (the judge says which) is answered again: the files are cut before the first of them, and
the answers kept after it are written again in their turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

from prefixgrove.output_files import read_output


class ResumeMismatch(ValueError):
    """The files on disk are not a prefix of this job's answers (another input's, or edited)."""


@dataclass(frozen=True)
class Judged:
    """What a line of the files is to one line of the job."""

    theirs: bool  # it answers that line: the same position and custom_id
    stale: str = ""  # why that answer cannot be kept (its request changed...); "" keeps it


NOT_THEIRS = Judged(False)
KEEP = Judged(True)

# judge(index, line, failed): what `line` of the output file (failed=False) or of the error file
# (failed=True) is to the job's line `index`
Judge = Callable[[int, str, bool], Judged]


@dataclass(frozen=True)
class Resumed:
    """How a resumed run takes up what an earlier one wrote: each file keeps its first `sizes`
    bytes, which answer the job's lines 0..start-1; `kept` holds the answers of later lines that
    are kept all the same (written again in their turn); the lines in `stale` (with why) and
    those from `count` on run."""

    start: int = 0
    count: int = 0
    sizes: tuple[int, int] = (0, 0)
    kept: dict[int, tuple[str, bool]] = field(default_factory=dict)  # index: (line, failed)
    stale: dict[int, str] = field(default_factory=dict)

    def runs(self, index: int) -> bool:
        return (index >= self.count or index in self.stale) and index not in self.kept

    @property
    def skipped(self) -> int:
        """Lines answered by the earlier run and kept (past the files' prefix too: the answers
        a stopped run held, held_answers.py)."""
        return self.count - len(self.stale) + sum(1 for i in self.kept if i >= self.count)

    def keeping(self, more: dict[int, tuple[str, bool]]) -> Resumed:
        """These answers of lines past the files' prefix kept too, written in their turn."""
        return replace(self, kept={**self.kept, **more})


class OrderedWriter:
    """Holds finished lines until every line before them is answered, then appends them to their
    file; `flush` writes what is ready and flushes both files, so a kill leaves whole lines.
    `kept`: answers of an earlier run (Resumed.kept), written in their turn but not counted."""

    def __init__(
        self,
        output: BinaryIO,
        errors: BinaryIO,
        start: int = 0,
        kept: dict[int, tuple[str, bool]] | None = None,
    ) -> None:
        self._files = (output, errors)
        self._next = start  # the first line index not yet written
        self._held = {i: (line, failed, False) for i, (line, failed) in (kept or {}).items()}
        self.written = [0, 0]  # output lines, error lines this run answered and wrote

    @property
    def next_index(self) -> int:
        return self._next

    @property
    def held(self) -> dict[int, tuple[str, bool]]:
        """The answers not written yet (a line before them is unanswered): index: (line, failed)."""
        return {i: (line, failed) for i, (line, failed, _) in self._held.items()}

    def put(self, index: int, line: str, failed: bool = False) -> None:
        if index < self._next or index in self._held:
            raise ValueError(f"line {index} was already answered")
        self._held[index] = (line, failed, True)

    def flush(self) -> None:
        while self._next in self._held:
            line, failed, counted = self._held.pop(self._next)
            self._files[failed].write(line.encode("utf-8") + b"\n")
            self.written[failed] += counted
            self._next += 1
        for f in self._files:
            f.flush()


def read_back(output: Path | str, errors: Path | str, total: int, judge: Judge) -> Resumed:
    """Reads back what an earlier run wrote for a job of `total` lines: how far the answered
    prefix goes (a torn last line, or lines one file wrote ahead of the other, are left out),
    which of its answers are stale, and where to cut the files; raises ResumeMismatch when the
    files answer another job. Changes nothing on disk."""
    files = (_whole_lines(output), _whole_lines(errors))
    taken = [0, 0]  # lines of each file read as answers
    cut: tuple[int, int] | None = None  # lines of each file before the first stale answer
    kept: dict[int, tuple[str, bool]] = {}
    stale: dict[int, str] = {}
    start = index = 0
    while index < total:
        found = _answer(index, files, taken, judge)
        if found is None:
            break
        failed, verdict = found
        line = files[failed][taken[failed]]
        if verdict.stale:
            stale[index] = verdict.stale
            if cut is None:
                cut, start = (taken[0], taken[1]), index
        elif cut is not None:
            kept[index] = (line, failed)
        taken[failed] += 1
        index += 1
    for side, path in enumerate((output, errors)):
        _check_ahead(path, files[side][taken[side] :], taken[side], index, total, judge,
                     bool(side))  # fmt: skip
    lines = (taken[0], taken[1]) if cut is None else cut
    sizes = (_size(files[0][: lines[0]]), _size(files[1][: lines[1]]))
    return Resumed(index if cut is None else start, index, sizes, kept, stale)


def _answer(
    index: int, files: tuple[list[str], list[str]], taken: list[int], judge: Judge
) -> tuple[bool, Judged] | None:
    """Which file's next line answers line `index` (False: the output file), and how."""
    for failed in (False, True):
        if taken[failed] < len(files[failed]):
            verdict = judge(index, files[failed][taken[failed]], failed)
            if verdict.theirs:
                return failed, verdict
    return None


def _whole_lines(path: Path | str) -> list[str]:
    """The file's complete lines (a last line without its newline is torn, so dropped)."""
    data = read_output(path)
    # NOTE: split on b"\n" alone: a JSON line may hold U+2028 and other breaks that splitlines cuts.
    lines = data.split(b"\n")[:-1]
    try:
        return [line.decode("utf-8") for line in lines]
    except UnicodeDecodeError as exc:
        raise ResumeMismatch(f"{path} is not a job's output (not UTF-8: {exc})") from None


def _check_ahead(
    path: Path | str,
    lines: list[str],
    kept: int,
    start: int,
    total: int,
    judge: Judge,
    failed: bool,
) -> None:
    """Lines past the answered prefix are only acceptable as answers to later lines, in order."""
    index = start
    for number, line in enumerate(lines, kept + 1):
        while index < total and not judge(index, line, failed).theirs:
            index += 1
        if index == total:
            raise ResumeMismatch(
                f"{path} does not answer this input: its line {number} ({line[:80]!r}) answers "
                f"none of the input's requests from request {start + 1} on; resume only over the "
                "files of the same input, or run without --resume to overwrite them"
            )
        index += 1


def _size(lines: list[str]) -> int:
    return sum(len(line.encode("utf-8")) + 1 for line in lines)
