"""Inputs the planner reads itself, from object storage: a job created with `source` (a
BatchJob's `spec.input.url`) streams the object in on a thread of this replica, through the same
AddRequests and SealJob calls a client's upload takes, and is sealed once it is read.

The object is read in bounded chunks (JSONL) or a row group at a time (Parquet), with the job's
own credentials when it brings them (storage/stores.py's job_credentials: this thread alone sees
them; they are never stored or logged). An object that cannot be read fails its job with the
code `input_unreadable` and a message naming the URL and why; the lines read before go with it.
A planner that stops mid-read leaves the job to the other replicas, which fail it
(`ingest_interrupted`) as they fail a client's upload left half-way."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc

from prefixgrove.input_lines import batch_lines, line_batches
from prefixgrove.planner.http.errors import ApiError, ServiceCall
from prefixgrove.request_defaults import with_body_defaults
from prefixgrove.storage.locations import ObjectLocation, StorageError
from prefixgrove.storage.stores import job_credentials
from prefixgrove_proto import planner_pb2 as pb

if TYPE_CHECKING:
    from prefixgrove.planner.service import PlannerService

log = logging.getLogger(__name__)
FORMATS = ("jsonl", "parquet")
UNREADABLE = "input_unreadable"
_READERS = 4  # objects read at once by one replica
_CHUNK_LINES = 1 << 16  # lines handed to AddRequests at once, as a client's upload sends them
_CHUNK_BYTES = 1 << 20


class ObjectInputs:
    def __init__(self, service: PlannerService) -> None:
        self.service = service
        self._readers = ThreadPoolExecutor(_READERS, thread_name_prefix="object-input")

    def check(self, source: pb.InputSource, context: grpc.ServicerContext) -> None:
        """Refuses, INVALID_ARGUMENT, a source that names nothing the planner can read."""
        try:
            _checked(source)
        except (StorageError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"source: {exc}")

    def start(self, job_id: str, source: pb.InputSource) -> None:
        self._readers.submit(self._read, job_id, source)

    def close(self) -> None:
        self._readers.shutdown(wait=False, cancel_futures=True)

    def _read(self, job_id: str, source: pb.InputSource) -> None:
        call = ServiceCall()
        try:
            with job_credentials(dict(source.credentials)):
                max_line = self.service.ingest_settings.max_line_bytes
                self.service.AddRequests(_chunks(job_id, source, max_line), call)
            self.service.SealJob(pb.SealJobRequest(job_id=job_id), call)
            log.info("job %s: read its input from %s", job_id, source.url)
        except ApiError as exc:  # cancelled meanwhile, or refused whole: the job says why
            log.info("job %s was not queued: %s", job_id, exc.message)
        except (StorageError, ValueError) as exc:  # pyarrow's errors are ValueErrors
            self._fail(job_id, f"{source.url}: {exc}" if source.url not in str(exc) else str(exc))
        except Exception as exc:
            log.exception("job %s: its input did not stream in from %s", job_id, source.url)
            self._fail(job_id, f"{source.url}: reading failed ({type(exc).__name__})")

    def _fail(self, job_id: str, message: str) -> None:
        log.warning("job %s failed: %s", job_id, message)
        self.service.ingests.fail(job_id, UNREADABLE, message)
        self.service.uploads.drop_unsealed_requests(job_id)


def _checked(source: pb.InputSource) -> dict[str, Any]:
    """The body defaults, once the source is one the planner can read."""
    ObjectLocation.parse(source.url)
    if source.format not in ("", *FORMATS):
        raise ValueError(f"format {source.format!r} is not read: expected one of {FORMATS}")
    if source.format == "parquet" and bool(source.prompt_column) == bool(source.messages_column):
        raise ValueError("a Parquet input needs one of prompt_column and messages_column")
    defaults = json.loads(source.body_defaults_json or "{}")
    if not isinstance(defaults, dict):
        raise ValueError("body_defaults_json must be a JSON object")
    return defaults


def _chunks(
    job_id: str, source: pb.InputSource, max_line_bytes: int
) -> Iterator[pb.AddRequestsChunk]:
    defaults = _checked(source)
    sent = False
    for batch in _batches(source, max_line_bytes):
        lines = [with_body_defaults(line, defaults) for line in batch]
        yield pb.AddRequestsChunk(job_id=job_id, lines=lines)
        sent = True
    if not sent:  # an empty input: the seal fails the job as empty
        yield pb.AddRequestsChunk(job_id=job_id, lines=[])


def _batches(source: pb.InputSource, max_line_bytes: int) -> Iterable[list[bytes]]:
    if source.format != "parquet":
        return line_batches(source.url, max_line_bytes, _CHUNK_LINES, _CHUNK_BYTES)
    from prefixgrove import parquet_jobs

    columns = parquet_jobs.ParquetColumns(
        source.prompt_column, source.messages_column, source.id_column
    )
    return batch_lines(parquet_jobs.request_lines(source.url, columns), _CHUNK_LINES, _CHUNK_BYTES)
