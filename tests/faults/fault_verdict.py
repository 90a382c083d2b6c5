"""The campaign's invariants, checked on the downloaded files against `prefixgrove run` of the same
batch: every custom_id answered exactly once and in input order, every answer but the poison
requests' equal to the local run's, and each poison request failed alone with its own
`worker_failed` line.

NOTE: two departures are counted apart rather than as violations, because the product makes them
by design:
- `float_drift`: an answer that differs from the local run's only in the last bits of its
  logprobs (or in which of two tied alternatives a top_logprobs entry names). A request run on its
  own, as the worker runs a group that failed two deliveries, takes no shared prefix and is decoded
  in a batch of one, so its float32 sums come out in another order.
- `failed_by_kills`: a request the campaign's SIGKILL caught running alone is failed as if it had
  killed the worker (`a worker died running this request alone`): the next delivery cannot tell a
  kill from outside from a crash. Each worker kill may cost one such request, no more."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# float32 noise is about 1e-7 relative; a changed token changes logprobs by far more
_REL_TOL = 1e-5
_DIED_ALONE = "a worker died running this request alone"  # runner.py's words


@dataclass(frozen=True)
class Verdict:
    duplicates: int  # answers beyond the local run's count of their custom_id
    missing: int  # answers the local run has and the job lacks
    mismatches: int  # answers of ordinary requests that differ from the local run's
    float_drift: int  # answers equal to the local run's but for float noise in their numbers
    failed_by_kills: list[str]  # ordinary requests failed for running alone when a worker died
    other_failed: list[str]  # any other custom_id failed by the job that the local run answered
    worker_kills: int  # the campaign's: each may cost one request in failed_by_kills
    poison_ok: bool  # each poison request: one line, an error, code worker_failed
    in_order: bool  # both files answer the ordinary requests in the local run's order
    byte_equal: bool  # the output file, and the error file less the poison lines, equal the local's

    @property
    def ok(self) -> bool:
        exact = self.duplicates == self.missing == self.mismatches == 0
        blamed_ok = len(self.failed_by_kills) <= self.worker_kills
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
    blamed = {_custom_id(x) for x in unexpected if _message(x) == _DIED_ALONE} - poison
    skip = {*poison, *blamed}
    by_id: dict[str | None, list[str]] = {}
    for line in ref_out:
        by_id.setdefault(_custom_id(line), []).append(line)
    kinds = Counter(_compare(line, by_id.get(_custom_id(line), [])) for line in _less(out, skip))
    return Verdict(
        duplicates=sum((got_ids - ref_ids).values()),
        missing=sum((ref_ids - got_ids).values()),
        mismatches=kinds["mismatch"],
        float_drift=kinds["drift"],
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


def _compare(line: str, candidates: list[str]) -> str:
    """One of "equal", "drift" (equal but for float noise) or "mismatch", against the local run's
    lines of the same custom_id."""
    if line in candidates:
        return "equal"
    parsed = json.loads(line)
    if any(_close(parsed, json.loads(c)) for c in candidates):
        return "drift"
    return "mismatch"


def _close(a: Any, b: Any) -> bool:
    """Equal JSON values, floats within _REL_TOL of each other; a mapping of floats (a
    top_logprobs entry) may name other keys for values within _REL_TOL (a tie broken otherwise)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=_REL_TOL)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict) and a.keys() != b.keys():
        floats = all(isinstance(x, float) for x in [*a.values(), *b.values()])
        return floats and _close(sorted(a.values()), sorted(b.values()))
    if isinstance(a, dict):
        return all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _failed_alone(out: list[str], err: list[str], custom_id: str) -> bool:
    mine = [line for line in err if _custom_id(line) == custom_id]
    no_output = not any(_custom_id(line) == custom_id for line in out)
    return no_output and len(mine) == 1 and json.loads(mine[0])["error"]["code"] == "worker_failed"


def _message(line: str) -> str:
    return str((json.loads(line).get("error") or {}).get("message", ""))


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _ids(lines: list[str]) -> list[str | None]:
    return [_custom_id(line) for line in lines]


def _custom_id(line: str) -> str | None:
    value = json.loads(line).get("custom_id")
    return None if value is None else str(value)
