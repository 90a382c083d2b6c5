"""The files uploaded through the OpenAI Batch API: what a store of them does (Files), and the
one kept on the planner's disk (FileStore; object_files.py keeps them in a bucket).

Layout under `root`: `<file id>` holds the content, `<file id>.json` the file object OpenAI's
clients read (id, bytes, created_at, filename, purpose). A file is written under a temporary name
(`.<file id>.partial`) and renamed once whole, so a listed file is always complete. The upload
writing a partial file holds a lock on it (flock) until it is renamed or dropped: a partial file
nobody holds was left by a planner that stopped mid-upload, and is deleted when a planner starts
(replicas sharing the folder leave each other's uploads alone)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from prefixgrove.planner.http.errors import not_found

log = logging.getLogger(__name__)
READ_CHUNK = 64 << 10


@dataclass(frozen=True)
class PartialFile:
    """An upload being written: its file id, and the open handle whose lock says it is alive."""

    id: str
    handle: BinaryIO


class Files(Protocol):
    """Uploaded files: a listed file is always whole, and an upload a planner left half-way is
    dropped (`reclaim_partials`) without touching the uploads other replicas are writing."""

    @property
    def root(self) -> Path | str:
        """Where they are, as the planner's log names it."""

    def create(self) -> PartialFile: ...
    def finish(self, upload: PartialFile, filename: str, purpose: str) -> dict[str, Any]: ...
    def discard(self, upload: PartialFile) -> None: ...
    def reclaim_partials(self) -> list[str]: ...
    def get(self, file_id: str) -> dict[str, Any]: ...
    def list(self) -> list[dict[str, Any]]: ...
    def source(self, file_id: str) -> Path | str:
        """The file's content as the input readers take it: a path, or an object's URL."""

    def chunks(self, file_id: str) -> Iterator[bytes]: ...
    def delete(self, file_id: str) -> dict[str, Any]: ...


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.reclaim_partials()

    def create(self) -> PartialFile:
        """A new file, locked as alive until `finish` makes it visible or `discard` drops it."""
        while True:
            file_id = f"file-{uuid.uuid4().hex[:24]}"
            path = self._partial(file_id)
            handle = path.open("xb")
            fcntl.flock(handle, fcntl.LOCK_EX)
            # NOTE: a planner starting between the open and the lock may have reclaimed the
            # file; its name then no longer leads to ours.
            if _same_file(path, handle):
                return PartialFile(file_id, handle)
            handle.close()

    def finish(self, upload: PartialFile, filename: str, purpose: str) -> dict[str, Any]:
        upload.handle.flush()
        size = os.fstat(upload.handle.fileno()).st_size
        obj = file_object(upload.id, size, time.time(), filename, purpose)
        (self.root / f"{upload.id}.json").write_text(json.dumps(obj))
        os.replace(self._partial(upload.id), self.root / upload.id)
        return obj

    def discard(self, upload: PartialFile) -> None:
        """Drops an upload that broke or was refused before `finish` (a finished one was renamed
        away: nothing to drop), and lets its lock go."""
        self._partial(upload.id).unlink(missing_ok=True)
        upload.handle.close()

    def reclaim_partials(self) -> list[str]:
        """Deletes the partial files no upload holds (a planner stopped while writing them);
        returns their names."""
        reclaimed = []
        for path in self.root.glob(".file-*.partial"):
            try:
                with path.open("rb") as f:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    path.unlink()
            except (BlockingIOError, FileNotFoundError):  # being written, or gone meanwhile
                continue
            reclaimed.append(path.name)
        if reclaimed:
            log.info("deleted %d partial uploads left in %s", len(reclaimed), self.root)
        return reclaimed

    def _partial(self, file_id: str) -> Path:
        return self.root / f".{file_id}.partial"

    def get(self, file_id: str) -> dict[str, Any]:
        meta = self.root / f"{checked_id(file_id)}.json"
        if not meta.exists() or not (self.root / file_id).exists():
            raise not_found("file", file_id)
        return dict(json.loads(meta.read_text()))

    def list(self) -> list[dict[str, Any]]:
        """Every file, newest first."""
        objects = []
        for meta in self.root.glob("file-*.json"):
            try:
                objects.append(json.loads(meta.read_text()))
            except (FileNotFoundError, ValueError):  # deleted, or being written, meanwhile
                continue
        return sorted(objects, key=lambda o: (-o["created_at"], o["id"]))

    def source(self, file_id: str) -> Path:
        self.get(file_id)
        return self.root / file_id

    def chunks(self, file_id: str) -> Iterator[bytes]:
        with self.source(file_id).open("rb") as f:
            while chunk := f.read(READ_CHUNK):
                yield chunk

    def delete(self, file_id: str) -> dict[str, Any]:
        self.get(file_id)
        (self.root / file_id).unlink(missing_ok=True)
        (self.root / f"{file_id}.json").unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}


def file_object(
    file_id: str, size: int, created_at: float, filename: str, purpose: str
) -> dict[str, Any]:
    return {"id": file_id, "object": "file", "bytes": size, "created_at": int(created_at),
            "filename": filename, "purpose": purpose, "status": "processed",
            "status_details": None}  # fmt: skip


def checked_id(file_id: str) -> str:
    """An id names a file in `root` and nothing outside it."""
    if not file_id.startswith("file-") or not file_id[5:].replace("-", "").isalnum():
        raise not_found("file", file_id)
    return file_id


def _same_file(path: Path, handle: BinaryIO) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return False
