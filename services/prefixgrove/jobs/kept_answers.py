"""Which answers an earlier `prefixgrove run` wrote a resumed run keeps: only those that are the
answer this run gives the same request. The judge read_back (ordered_writer.py) asks about each
line of the files:

- a success line is kept when its id names the line's position, custom_id and the fingerprint of
  its request now (`batch_req_<r><h><f>`, output_lines.py; the run tag `<r>` may be any, and ids
  of versions before run tags, `batch_req_<h><f>`, are read too): a new prompt, max_tokens or any
  other setting that can change the answer gives another fingerprint;
- an error line is kept when it is, byte for byte, the error this run gives the line (its
  validation error, or the engine's refusal);
- any other answer at that position (the same index and custom_id; either custom_id may be missing,
  from a line that did not parse) is stale: the line runs again, and the reason is reported;
- a line answering another position or custom_id is not this input's answer at all.

A success line written before ids carried a fingerprint (`batch_req_<h>` alone) cannot be tied to
the request it answered, so it is stale too ("no request fingerprint").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from prefixgrove.jobs.ordered_writer import KEEP, NOT_THEIRS, Judged
from prefixgrove.jobs.output_lines import RUN_TAG_CHARS, request_fingerprint, request_hash
from prefixgrove.jobs.request_errors import RequestError

_HEAD = '{"id": "batch_req_'
_CUSTOM_ID = '", "custom_id": '
_HASH_CHARS = len(request_hash(0, ""))
_FINGERPRINT_CHARS = len(request_fingerprint("", {}, [], None))
_DECODER = json.JSONDecoder()

NO_FINGERPRINT = "no request fingerprint (answered by an older prefixgrove)"
CHANGED = "request changed"


@dataclass(frozen=True)
class ExpectedAnswers:
    """What this run answers each line of the job with."""

    runs: dict[int, tuple[str, str]]  # index: (custom_id, request fingerprint) of what runs
    fails: dict[int, RequestError]  # index: the error of a line that will not run
    # the run tag of the first answer kept, which the resumed run writes its own lines under
    kept_tag: list[str] = field(default_factory=list)

    def custom_id(self, index: int) -> str | None:
        error = self.fails.get(index)
        return self.runs[index][0] if error is None else error.custom_id

    def judge(self, index: int, line: str, failed: bool) -> Judged:
        identity = _identity(line)
        if identity is None:
            return NOT_THEIRS
        tag, hashed, fingerprint, named = identity
        error = self.fails.get(index)
        if error is not None:
            if failed and line == error.to_line(tag):
                return self._kept(tag)
            custom_id = error.custom_id
        else:
            custom_id, now = self.runs[index]
            if not failed and fingerprint == now and hashed == request_hash(index, custom_id):
                return self._kept(tag)
        if not _same_position(index, custom_id, hashed, named):
            return NOT_THEIRS
        if error is not None:
            return Judged(True, f"now fails ({error.code})")
        if failed:
            return Judged(True, f"was an error ({_error_code(line)}), now runs")
        return Judged(True, CHANGED if fingerprint else NO_FINGERPRINT)

    def _kept(self, tag: str) -> Judged:
        if tag and not self.kept_tag:
            self.kept_tag.append(tag)
        return KEEP


def _split(ident: str) -> tuple[str, str, str]:
    """(run tag, position hash, fingerprint) of an id's hex digits; ids written before run
    tags have none."""
    for tag in (RUN_TAG_CHARS, 0):
        if len(ident) - tag in (_HASH_CHARS, _HASH_CHARS + _FINGERPRINT_CHARS):
            return ident[:tag], ident[tag : tag + _HASH_CHARS], ident[tag + _HASH_CHARS :]
    return "", ident[:_HASH_CHARS], ident[_HASH_CHARS:]


def _identity(line: str) -> tuple[str, str, str, str | None] | None:
    """(run tag, position hash, fingerprint, custom_id) of a line as output_lines writes it."""
    if not line.startswith(_HEAD):
        return None
    end = line.find(_CUSTOM_ID, len(_HEAD))
    if end < 0:
        return None
    ident = line[len(_HEAD) : end]
    try:
        custom_id, _ = _DECODER.raw_decode(line, end + len(_CUSTOM_ID))
    except ValueError:
        return None
    if custom_id is not None and not isinstance(custom_id, str):
        return None
    return (*_split(ident), custom_id)


def _same_position(index: int, custom_id: str | None, hashed: str, named: str | None) -> bool:
    """The line was written for line `index` (its id says so) under the same custom_id."""
    if hashed != request_hash(index, named):
        return False
    return named == custom_id or named is None or custom_id is None


def _error_code(line: str) -> str:
    try:
        return str(json.loads(line)["error"]["code"])
    except (ValueError, TypeError, KeyError):
        return "unknown"
