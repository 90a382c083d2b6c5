"""A BatchJob's results written to `spec.output.url` / `errorsUrl` as they arrive, the way
results.py writes them to the volume, through the bucket's staged parts (storage/staged.py).

Each round uploads the lines answered since the last one as a part of each object (the operator
holds at most about a part of each in memory: PREFIXGROVE_OBJECT_PART_BYTES), then records where
they stand in a marker object beside the output, `<output>.prefixgrove-written`, holding the same
fields as the volume's marker. A round that stopped between its parts and its marker is undone by
the next one: the parts past the marker's sizes are dropped. The last round, once the planner job
is final, commits both objects (each appears whole under its name, or not at all) and deletes the
marker. Nothing is read back from the bucket but a part that straddles the marker's size.
Credentials are the BatchJob's Secret's when it names one (credentials.py)."""

from __future__ import annotations

from collections.abc import Mapping

from prefixgrove import settings as cfg
from prefixgrove.planner.client import PlannerClient
from prefixgrove.settings import StorageSettings
from prefixgrove.storage import objects
from prefixgrove.storage.locations import ObjectLocation
from prefixgrove.storage.staged import StagedObject, staged_pair
from prefixgrove.storage.stores import job_credentials
from prefixgrove_operator.results import (
    Failure,
    Progress,
    copy_results,
    lock_for,
    marker_text,
    parse_marker,
)

MARKER_SUFFIX = ".prefixgrove-written"
_MARKER_BYTES = 200  # its six fields, read whole


def append_new_objects(
    planner: PlannerClient,
    job_id: str,
    output: str,
    errors: str,
    finished: bool,
    credentials: Mapping[str, str],
) -> tuple[Progress, Failure | None]:
    """Appends the results answered since the last call as parts of both objects; `finished`:
    the planner job is final, so this call writes every line left and commits both. A store
    that refuses raises StorageError (an OSError) naming the URL and why."""
    part_bytes = cfg.load(StorageSettings).object_part_bytes
    with lock_for(output), job_credentials(credentials):
        marker = ObjectLocation.parse(output).sibling(MARKER_SUFFIX)
        out, err, start = _resumed(output, errors, part_bytes, _read_marker(marker, job_id))
        progress, failure = copy_results(planner, job_id, start, _Uploading(out), _Uploading(err))
        out.checkpoint()  # this round's lines, as a part of each object
        if finished:
            out.commit()
            err.commit()
            objects.delete(marker)
        else:
            objects.put(marker, marker_text(job_id, progress).encode())
    return progress, failure


def _resumed(
    output: str, errors: str, part_bytes: int, start: Progress
) -> tuple[StagedObject, StagedObject, Progress]:
    """Both objects going on after what the marker says was written; both start over when the
    parts hold less (never padded)."""
    out, err = staged_pair(output, errors, part_bytes)
    try:
        out.start(start.output_size)
        err.start(start.errors_size)
        return out, err, start
    except ValueError:
        out, err = staged_pair(output, errors, part_bytes)
        out.start()
        err.start()
        return out, err, Progress()


def _read_marker(marker: ObjectLocation, job_id: str) -> Progress:
    size = objects.size_of(marker)
    if not size or size > _MARKER_BYTES:  # none, or not one of ours
        return Progress()
    return parse_marker(objects.read_range(marker, 0, size).decode(errors="replace"), job_id)


class _Uploading:
    """A staged object that uploads a part whenever it holds one (and its partner's with it)."""

    def __init__(self, staged: StagedObject) -> None:
        self.staged = staged

    def write(self, data: bytes, /) -> int:
        self.staged.write(data)
        self.staged.flush()
        return len(data)
