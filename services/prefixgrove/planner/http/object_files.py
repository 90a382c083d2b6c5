"""The files uploaded through the OpenAI Batch API, kept in a bucket (`--files-url s3://B/PREFIX`):
they outlive a planner pod, and every replica lists and reads the same files.

Layout under the prefix, as on disk (files.py): `<file id>` holds the content, `<file id>.json`
the file object. An upload is written as staged parts beside its content object
(storage/staged.py; the planner holds about one part of it), committed whole when it ends, and
only then is its `.json` written: a listed file is always complete, and a replica that stops
mid-upload leaves parts and no file. Parts no upload has touched for a day are deleted when a
planner starts (an upload that long is long dead: its client timed out).
Credentials are the planner's own (its environment, IRSA, workload identity)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, BinaryIO, cast

from prefixgrove.planner.http.errors import not_found
from prefixgrove.planner.http.files import PartialFile, checked_id, file_object
from prefixgrove.storage import objects
from prefixgrove.storage.locations import ObjectLocation, StorageError
from prefixgrove.storage.staged import PARTS_SUFFIX, StagedObject
from prefixgrove.storage.stores import storage_error, store_for

log = logging.getLogger(__name__)
STALE_PARTS = timedelta(days=1)


def files_prefix(url: str) -> ObjectLocation:
    """The location whose key is the prefix every file's key starts with (`` or `PREFIX/`)."""
    parsed = ObjectLocation.parse(url.rstrip("/") + "/file")
    return ObjectLocation(parsed.scheme, parsed.bucket, parsed.key.removesuffix("file"))


class ObjectFileStore:
    def __init__(self, url: str, part_bytes: int) -> None:
        self.prefix = files_prefix(url)
        self.root = url  # what the planner's log names
        self.part_bytes = part_bytes
        objects.listed(self.prefix)  # a bucket that is missing or refused fails the start
        self.reclaim_partials()

    def _at(self, key: str) -> ObjectLocation:
        return ObjectLocation(self.prefix.scheme, self.prefix.bucket, self.prefix.key + key)

    def create(self) -> PartialFile:
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        staged = StagedObject(self._at(file_id).url, self.part_bytes)
        staged.start()
        return PartialFile(file_id, cast(BinaryIO, _Upload(staged)))

    def finish(self, upload: PartialFile, filename: str, purpose: str) -> dict[str, Any]:
        staged = cast(_Upload, upload.handle).staged
        staged.commit()
        size = objects.size_of(staged.location) or 0
        obj = file_object(upload.id, size, time.time(), filename, purpose)
        objects.put(self._at(f"{upload.id}.json"), json.dumps(obj).encode())
        cast(_Upload, upload.handle).finished = True
        return obj

    def discard(self, upload: PartialFile) -> None:
        """Drops the parts of an upload that broke or was refused before `finish`."""
        handle = cast(_Upload, upload.handle)
        if not handle.finished:
            StagedObject(handle.staged.url, self.part_bytes).start()  # keeps nothing

    def reclaim_partials(self) -> list[str]:
        """Deletes the parts of uploads untouched for STALE_PARTS; returns their keys."""
        import obstore

        before = datetime.now(UTC) - STALE_PARTS
        stale: list[str] = []
        try:
            for page in obstore.list(store_for(self.prefix), self.prefix.key):
                stale += [str(m["path"]) for m in page
                          if PARTS_SUFFIX in str(m["path"]) and m["last_modified"] < before]  # fmt: skip
        except Exception as exc:
            raise storage_error(exc, self.prefix.url, "listing") from None
        for key in stale:
            objects.delete(ObjectLocation(self.prefix.scheme, self.prefix.bucket, key))
        if stale:
            log.info("deleted %d parts of uploads left in %s", len(stale), self.root)
        return stale

    def get(self, file_id: str) -> dict[str, Any]:
        meta = self._at(f"{checked_id(file_id)}.json")
        size = objects.size_of(meta)
        if size is None:
            raise not_found("file", file_id)
        return dict(json.loads(objects.read_range(meta, 0, size)))

    def list(self) -> list[dict[str, Any]]:
        """Every file, newest first."""
        found = []
        # NOTE: a store lists a folder (`files/`), not any prefix of a name (`files/file-`)
        for key, size in objects.listed(self.prefix):
            name = key.removeprefix(self.prefix.key)
            if "/" in name or not (name.startswith("file-") and name.endswith(".json")):
                continue
            meta = ObjectLocation(self.prefix.scheme, self.prefix.bucket, key)
            try:
                found.append(json.loads(objects.read_range(meta, 0, size)))
            except (StorageError, ValueError):  # deleted meanwhile
                continue
        return sorted(found, key=lambda o: (-o["created_at"], o["id"]))

    def source(self, file_id: str) -> str:
        """The file's content, by URL (what a batch's input is read from)."""
        self.get(file_id)
        return self._at(file_id).url

    def chunks(self, file_id: str) -> Iterator[bytes]:
        yield from objects.stream(ObjectLocation.parse(self.source(file_id)))

    def delete(self, file_id: str) -> dict[str, Any]:
        self.get(file_id)
        objects.delete(self._at(f"{file_id}.json"))  # unlisted first: never listed half-deleted
        objects.delete(self._at(file_id))
        return {"id": file_id, "object": "file", "deleted": True}


class _Upload:
    """An upload's handle: written a chunk at a time, a part uploaded whenever one is full."""

    def __init__(self, staged: StagedObject) -> None:
        self.staged = staged
        self.finished = False

    def write(self, data: bytes) -> int:
        self.staged.write(data)
        self.staged.flush()
        return len(data)

    def close(self) -> None:
        return None
