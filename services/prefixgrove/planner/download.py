"""A job's results downloaded into its output and error files, in input order, resumably.

While a download runs, a marker beside the output, `<output>.offset`, says how far it got: one JSON
object naming the job, the next input index, and for each file its size, its line count and the
blake2b digest of those bytes. It is written, whole (a new file renamed over the old), every
`MARK_EVERY` lines and when the download stops on an error or an interrupt, and removed at the end.

A download resumes only from what it can verify: both files hold at least the bytes the marker
names, and those bytes hash to its digests. Then each file is cut back to them (lines written after
the marker are downloaded again) and the download goes on from the marker's index. Anything else
(a file shorter than the marker says, edited, or missing; a marker of an older version, or one that
does not parse) starts the download over, saying why. A marker of another job is refused
(ValueError): its files belong to another download. So both files only ever hold whole lines.

Outputs named by URL (s3://, gs://) are written as parts and committed whole at the end
(prefixgrove/storage/staged.py); an interrupted download of them starts over.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, Protocol

from prefixgrove.output_files import (
    check_outputs,
    open_output,
    open_outputs,
    read_chunks,
    read_output,
    replaced,
)
from prefixgrove.storage.locations import is_url

log = logging.getLogger(__name__)
MARK_EVERY = 1000  # lines between two markers


class ResultLine(Protocol):
    """One line of StreamResults (planner_pb2.ResultLine)."""

    index: int
    is_error: bool
    line: str


# results(offset): the job's result lines from input index `offset` on, to the job's end
Results = Callable[[int], Iterable[ResultLine]]


class _Reached(NamedTuple):
    next: int  # the input index after the last line written
    output_size: int
    errors_size: int


def marker_path(output: Path) -> Path:
    return output.with_name(output.name + ".offset")


def check_paths(output: Path | str, errors: Path | str) -> None:
    """Refuses a download's paths (the files and the marker) that are links or name one file."""
    if is_url(output):
        check_outputs(output, errors)
    else:
        check_outputs(output, errors, marker_path(Path(output)))


@dataclass
class Tally:
    """What a file holds: its size, its lines and the digest of its bytes, kept as they grow."""

    size: int = 0
    lines: int = 0
    digest: Any = field(default_factory=lambda: hashlib.blake2b(digest_size=16))

    def add(self, data: bytes) -> None:
        self.size += len(data)
        self.lines += data.count(b"\n")
        self.digest.update(data)

    def as_json(self) -> dict[str, Any]:
        return {"size": self.size, "lines": self.lines, "blake2b": self.digest.hexdigest()}


def download(
    results: Results, job_id: str, output: Path | str, errors: Path | str
) -> tuple[int, int]:
    """Writes the job's results into `output` and `errors`, going on from an interrupted
    download of the same job where one can be verified; returns the lines each file holds."""
    if is_url(output) or is_url(errors):
        return _download_objects(results, output, errors)
    output, errors = Path(output), Path(errors)
    check_paths(output, errors)
    marker = marker_path(output)
    start, tallies = resume_point(marker, job_id, output, errors)
    with (
        open_output(output, tallies[0].size) as out,
        open_output(errors, tallies[1].size) as err,
    ):
        files = (out, err)
        # how far both files go, in one assignment: an interrupt lands before or after it
        reached = begun = _Reached(start, tallies[0].size, tallies[1].size)
        try:
            for n, result in enumerate(results(start), 1):
                data = result.line.encode() + b"\n"
                files[result.is_error].write(data)
                tallies[result.is_error].add(data)
                reached = _Reached(result.index + 1, tallies[0].size, tallies[1].size)
                if n % MARK_EVERY == 0:
                    _mark(marker, job_id, reached.next, files, tallies)
        except BaseException:
            if reached != begun:  # else the files are as the marker there (if any) says
                _mark_after_stop(marker, job_id, reached, files, (output, errors))
            raise
    marker.unlink(missing_ok=True)
    return tallies[0].lines, tallies[1].lines


def _download_objects(results: Results, output: Path | str, errors: Path | str) -> tuple[int, int]:
    """The whole download into outputs of which one at least is an object (by URL), each
    committed whole at the end."""
    check_outputs(output, errors)
    counts = [0, 0]
    with open_outputs(output, errors) as files:
        for result in results(0):
            files[result.is_error].write(result.line.encode() + b"\n")
            files[result.is_error].flush()
            counts[result.is_error] += 1
    return counts[0], counts[1]


def resume_point(
    marker: Path, job_id: str, output: Path, errors: Path
) -> tuple[int, tuple[Tally, Tally]]:
    """The input index to go on from and what each file keeps; (0, empty) to start over."""
    text = read_output(marker).decode(errors="replace")
    if not text:
        return 0, (Tally(), Tally())
    recorded = _parse(text)
    if recorded is None:
        return _start_over(marker, job_id, "it does not parse as a marker of this version")
    if recorded["job"] != job_id:
        raise ValueError(
            f"{marker} belongs to an interrupted download of job {recorded['job']}, not {job_id}: "
            f"finish that one, or delete the marker to write job {job_id} over its files"
        )
    if "next" not in recorded:
        return _start_over(marker, job_id, "it comes from a version that kept no digests")
    tallies = []
    for path, kept in ((output, recorded["output"]), (errors, recorded["errors"])):
        tally, problem = _verify(path, kept)
        if problem:
            return _start_over(marker, job_id, problem)
        tallies.append(tally)
    log.info("resuming the download of job %s at input line %d (%s)", job_id,
             recorded["next"] + 1, marker)  # fmt: skip
    return recorded["next"], (tallies[0], tallies[1])


def _parse(text: str) -> dict[str, Any] | None:
    """The marker's fields; an older marker (`JOB NEXT SIZE SIZE`) gives its job alone."""
    fields = text.split()
    if len(fields) == 4 and all(f.isdigit() for f in fields[1:]):
        return {"job": fields[0]}
    try:
        recorded = json.loads(text)
        files = [recorded["output"], recorded["errors"]]
        numbers = [recorded["next"], *(f[k] for f in files for k in ("size", "lines"))]
        if not isinstance(recorded["job"], str) or not all(_count(n) for n in numbers):
            return None
        if not all(isinstance(f["blake2b"], str) for f in files):
            return None
    except (ValueError, TypeError, KeyError):
        return None
    return dict(recorded)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _verify(path: Path, kept: dict[str, Any]) -> tuple[Tally, str]:
    """What `path` holds of the bytes the marker names, or why it cannot be trusted."""
    tally = Tally()
    for chunk in read_chunks(path, kept["size"]):
        tally.add(chunk)
    if tally.size < kept["size"]:
        return tally, f"{path} holds {tally.size} bytes, fewer than the {kept['size']} it names"
    if tally.digest.hexdigest() != kept["blake2b"] or tally.lines != kept["lines"]:
        return tally, f"the first {kept['size']} bytes of {path} changed since it was written"
    return tally, ""


def _start_over(marker: Path, job_id: str, why: str) -> tuple[int, tuple[Tally, Tally]]:
    log.warning("not resuming from %s: %s; downloading job %s from its first line",
                marker, why, job_id)  # fmt: skip
    return 0, (Tally(), Tally())


def _mark(
    marker: Path, job_id: str, at: int, files: tuple[BinaryIO, ...], tallies: tuple[Tally, ...]
) -> None:
    """Flushes both files, then records how far they go."""
    for f in files:
        f.flush()
    record = {"job": job_id, "next": at, "output": tallies[0].as_json(),
              "errors": tallies[1].as_json()}  # fmt: skip
    with replaced(marker) as f:
        f.write(json.dumps(record).encode())


def _mark_after_stop(
    marker: Path,
    job_id: str,
    reached: _Reached,
    files: tuple[BinaryIO, ...],
    paths: tuple[Path, Path],
) -> None:
    """After the stream stopped: a marker at the last line written whole. Its digests are read
    back from disk, since the stop may have come between a line's write and its tally. When a
    file cannot take what it was given, the last marker stays."""
    try:
        for f in files:
            f.flush()
        tallies = []
        for path, size in zip(paths, (reached.output_size, reached.errors_size), strict=True):
            tally = Tally()
            for chunk in read_chunks(path, size):
                tally.add(chunk)
            tallies.append(tally)
        _mark(marker, job_id, reached.next, files, tuple(tallies))
    except OSError as exc:
        log.warning("could not record how far the download got (%s): a resume goes on from "
                    "the last marker", exc)  # fmt: skip
