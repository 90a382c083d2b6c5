"""The campaign's invariants, checked on the downloaded files against `prefixgrove run` of the same
batch: every custom_id answered exactly once and in input order, every answer but the poison
requests' equal to the local run's, and each poison request failed alone with its own
`worker_failed` line.

Every answer must equal the local run's byte for byte: a request the worker runs apart keeps its
group's prefix, so no float drifts. NOTE: one departure is counted apart rather than as a
violation, because the product makes it by design: `failed_by_kills`, a request the campaign's
SIGKILL caught running alone twice, is failed as if it had killed workers (a delivery cannot tell a
kill from outside from a crash; one such death is forgiven, two are not). Each two worker kills may
cost one such request, no more."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from prefixgrove.worker.runner import DIED_ALONE

_KILLS_PER_BLAME = 2  # a request running alone is failed at its second death
_RUN_TAGGED = re.compile(r'("id": "(?:batch_req_|chatcmpl-|cmpl-)|"request_id": ")[0-9a-f]{12}')


@dataclass(frozen=True)
class Verdict:
    duplicates: int  # answers beyond the local run's count of their custom_id
    missing: int  # answers the local run has and the job lacks
    mismatches: int  # answers of ordinary requests that differ from the local run's in any byte
    failed_by_kills: list[str]  # ordinary requests failed for running alone at two worker deaths
    other_failed: list[str]  # any other custom_id failed by the job that the local run answered
    worker_kills: int  # the campaign's: each two may cost one request in failed_by_kills
    poison_ok: bool  # each poison request: one line, an error, code worker_failed
    in_order: bool  # both files answer the ordinary requests in the local run's order
    byte_equal: bool  # the output file, and the error file less the poison lines, equal the local's

    @property
    def ok(self) -> bool:
        exact = self.duplicates == self.missing == self.mismatches == 0
        blamed_ok = len(self.failed_by_kills) * _KILLS_PER_BLAME <= self.worker_kills
        return exact and blamed_ok and not self.other_failed and self.poison_ok and self.in_order


def judge(
    got: tuple[Path, Path], reference: tuple[Path, Path], poison: frozenset[str], worker_kills: int
) -> Verdict:
    """`got` and `reference` are (output file, error file)."""
    out, err = (_lines(p) for p in got)
    ref_out, ref_err = (_lines(p) for p in reference)
    got_ids = Counter(_custom_id(line) for line in out + err)
    ref_ids = Counter(_custom_id(line) for line in ref_out + ref_err)
    ref_failed = set(ref_err)
    unexpected = [line for line in err if line not in ref_failed]
    blamed = {_custom_id(x) for x in unexpected if _message(x) == DIED_ALONE} - poison
    skip = {*poison, *blamed}
    ref_answers = set(ref_out)
    return Verdict(
        duplicates=sum((got_ids - ref_ids).values()),
        missing=sum((ref_ids - got_ids).values()),
        mismatches=sum(line not in ref_answers for line in _less(out, skip)),
        failed_by_kills=sorted(str(b) for b in blamed),
        other_failed=[str(_custom_id(x)) for x in _less(unexpected, skip)],
        worker_kills=worker_kills,
        poison_ok=all(_failed_alone(out, err, custom_id) for custom_id in poison),
        in_order=_ids(out) == _ids(_less(ref_out, skip))
        and _ids(_less(err, skip)) == _ids(_less(ref_err, skip)),
        byte_equal=out == _less(ref_out, poison) and _less(err, poison) == _less(ref_err, poison),
    )


def _less(lines: list[str], custom_ids: set[str | None] | frozenset[str]) -> list[str]:
    """`lines` but those of `custom_ids`."""
    return [line for line in lines if _custom_id(line) not in custom_ids]


def _failed_alone(out: list[str], err: list[str], custom_id: str) -> bool:
    mine = [line for line in err if _custom_id(line) == custom_id]
    no_output = not any(_custom_id(line) == custom_id for line in out)
    return no_output and len(mine) == 1 and json.loads(mine[0])["error"]["code"] == "worker_failed"


def _message(line: str) -> str:
    return str((json.loads(line).get("error") or {}).get("message", ""))


def _lines(path: Path) -> list[str]:
    """The file's lines without the run tag in their ids: the job's and the local run's differ
    (every run tags its ids with its own), all else must be equal."""
    return _RUN_TAGGED.sub(r"\1", path.read_text()).splitlines()


def _ids(lines: list[str]) -> list[str | None]:
    return [_custom_id(line) for line in lines]


def _custom_id(line: str) -> str | None:
    value = json.loads(line).get("custom_id")
    return None if value is None else str(value)
