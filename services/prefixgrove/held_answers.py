"""Answers a stopped `prefixgrove run` had but could not write yet, kept beside its output for
`--resume`.

The output files answer a prefix of the job: line i is written once every line before it is
answered. A run stopped while an early request still ran (Ctrl-C, an error) holds the answers of
later lines in memory; they are kept in OUTPUT.held.jsonl (beside the output file, or the object
beside the output object), one JSON object a line, `{"index", "failed", "line"}`, written whole.
A resumed run judges each of them as it judges the files' own lines (kept_answers.py: the same
request's answer, or it runs again) and writes the kept ones in their turn; a run that ends with
every line written, or a run that starts afresh, removes the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefixgrove.output_files import read_chunks, replaced
from prefixgrove.storage import objects
from prefixgrove.storage.locations import ObjectLocation, is_url

Held = dict[int, tuple[str, bool]]  # line index: (its answer line, whether it is an error line)


def held_path(output: Path | str) -> Path | str:
    """Where the held answers of a run writing `output` are kept."""
    return f"{output}.held.jsonl" if is_url(output) else Path(f"{output}.held.jsonl")


def save_held(output: Path | str, held: Held) -> None:
    """Keeps `held` beside `output` (replacing what was kept), or removes the file if empty."""
    if not held:
        drop_held(output)
        return
    data = b"".join(
        json.dumps({"index": i, "failed": failed, "line": line}).encode() + b"\n"
        for i, (line, failed) in sorted(held.items())
    )
    where = held_path(output)
    if isinstance(where, str):
        objects.put(ObjectLocation.parse(where), data)
        return
    with replaced(where) as f:
        f.write(data)


def load_held(output: Path | str) -> Held:
    """What a stopped run kept beside `output` (nothing when it kept nothing); a line that does
    not read as a held answer is skipped, since its answer can run again."""
    where = held_path(output)
    if isinstance(where, str):
        location = ObjectLocation.parse(where)
        data = b"".join(objects.stream(location)) if objects.size_of(location) else b""
    else:
        data = b"".join(read_chunks(where))
    held: Held = {}
    for raw in data.splitlines():
        try:
            entry = json.loads(raw)
            index, failed, line = entry["index"], entry["failed"], entry["line"]
        except (ValueError, TypeError, KeyError):
            continue
        if isinstance(index, int) and isinstance(failed, bool) and isinstance(line, str):
            held[index] = (line, failed)
    return held


def drop_held(output: Path | str) -> None:
    where = held_path(output)
    if isinstance(where, str):
        location = ObjectLocation.parse(where)
        if objects.size_of(location) is not None:
            objects.delete(location)
        return
    where.unlink(missing_ok=True)
