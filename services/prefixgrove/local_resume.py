"""What `prefixgrove run --resume` takes up of an earlier run's files, and what a stopped run leaves
for it: the files' answered prefix (ordered_writer.py), judged line by line against this run's
requests (kept_answers.py), and the answers a stopped run held past that prefix
(held_answers.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prefixgrove.held_answers import held_path, load_held, save_held
from prefixgrove.jobs.kept_answers import ExpectedAnswers
from prefixgrove.jobs.ordered_writer import KEEP, OrderedWriter, Resumed, read_back
from prefixgrove.jobs.output_lines import request_fingerprint
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.jobs.requests import BatchRequest
from prefixgrove.output_files import open_outputs

if TYPE_CHECKING:
    from prefixgrove.engine import SamplingParams

log = logging.getLogger("prefixgrove.local")


@dataclass(frozen=True)
class Rerun:
    """A line an earlier run answered that this one ran again (--resume), and why."""

    line: int  # 1-based, as people count the input's lines
    custom_id: str | None
    reason: str


# nothing kept, nothing run again, no run tag to go on with
FRESH: tuple[Resumed, tuple[Rerun, ...], str | None] = (Resumed(), (), None)


@contextmanager
def open_writer(output: Path | str, errors: Path | str, done: Resumed) -> Iterator[OrderedWriter]:
    """The job's writer, going on after what `done` keeps of the files (all of them: none);
    objects (by URL) are committed whole when the run ends without an error."""
    with open_outputs(output, errors, done.sizes) as (out, err):
        yield OrderedWriter(out, err, done.start, done.kept)


def resume(
    output: Path | str,
    errors: Path | str,
    total: int,
    runnable: list[tuple[BatchRequest, list[int], SamplingParams]],
    failed: list[RequestError],
) -> tuple[Resumed, tuple[Rerun, ...], str | None]:
    """What the files already answer of this job (cut to whole lines of it), the lines they
    answered that run again, their answers being stale, and the run tag of the answers kept (the
    resumed run's lines take it too)."""
    expected = ExpectedAnswers(
        runs={
            request.index: (
                request.custom_id,
                request_fingerprint(request.endpoint, request.params, ids, request.model),
            )
            for request, ids, _ in runnable
        },
        fails={e.index: e for e in failed},
    )
    done = read_back(output, errors, total, expected.judge)
    held = {
        i: entry
        for i, entry in load_held(output).items()
        if done.count <= i < total
        and (i in expected.runs or i in expected.fails)
        and expected.judge(i, *entry) == KEEP
    }
    done = done.keeping(held)
    if held:
        log.info("resuming: %d answers a stopped run held are kept", len(held))
    reruns = tuple(
        Rerun(index + 1, expected.custom_id(index), why) for index, why in done.stale.items()
    )
    if done.count:
        log.info("resuming: %d of %d lines already answered in %s and %s; running the rest",
                 done.skipped, total, output, errors)  # fmt: skip
    if reruns:
        log.warning("resuming: %d answered lines run again, their answers being stale: %s",
                    len(reruns), rerun_text(reruns))  # fmt: skip
    return done, reruns, expected.kept_tag[0] if expected.kept_tag else None


def hold(output: Path | str, writer: OrderedWriter) -> None:
    """A stopped run's answers: those in order written, the rest kept for --resume."""
    try:
        writer.flush()
    finally:
        held = writer.held
        save_held(output, held)
        if held:
            log.warning("stopped: %d lines written; %d answered lines that follow an unanswered "
                        "one kept in %s for --resume", writer.next_index, len(held),
                        held_path(output))  # fmt: skip


def rerun_text(reruns: tuple[Rerun, ...], most: int = 20) -> str:
    """`line 4 (c3): request changed; ...`, the first `most` of them and how many more."""
    text = "; ".join(
        f"line {r.line}{'' if r.custom_id is None else f' ({r.custom_id})'}: {r.reason}"
        for r in reruns[:most]
    )
    return text + (f"; and {len(reruns) - most} more" if len(reruns) > most else "")
