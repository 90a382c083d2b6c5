"""The files uploaded through the OpenAI Batch API, kept on the planner's disk.

Layout under `root`: `<file id>` holds the content, `<file id>.json` the file object OpenAI's
clients read (id, bytes, created_at, filename, purpose). A file is written under a temporary name
(`.<file id>.partial`) and renamed once whole, so a listed file is always complete."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from prefixgrove.planner.http.errors import not_found

READ_CHUNK = 64 << 10


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def create(self) -> tuple[str, BinaryIO]:
        """A new file's id and the handle its content goes to; `finish` makes it visible."""
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        return file_id, self._partial(file_id).open("wb")

    def finish(self, file_id: str, filename: str, purpose: str) -> dict[str, Any]:
        partial = self._partial(file_id)
        obj = file_object(file_id, partial.stat().st_size, time.time(), filename, purpose)
        (self.root / f"{file_id}.json").write_text(json.dumps(obj))
        os.replace(partial, self.root / file_id)
        return obj

    def discard(self, file_id: str) -> None:
        """Drops an upload that broke or was refused before `finish`."""
        self._partial(file_id).unlink(missing_ok=True)

    def _partial(self, file_id: str) -> Path:
        return self.root / f".{file_id}.partial"

    def get(self, file_id: str) -> dict[str, Any]:
        meta = self.root / f"{_checked(file_id)}.json"
        if not meta.exists() or not (self.root / file_id).exists():
            raise not_found("file", file_id)
        return dict(json.loads(meta.read_text()))

    def list(self) -> list[dict[str, Any]]:
        """Every file, newest first."""
        objects = []
        for meta in self.root.glob("file-*.json"):
            try:
                objects.append(json.loads(meta.read_text()))
            except FileNotFoundError:  # deleted meanwhile
                continue
        return sorted(objects, key=lambda o: (-o["created_at"], o["id"]))

    def path(self, file_id: str) -> Path:
        self.get(file_id)
        return self.root / file_id

    def chunks(self, file_id: str) -> Iterator[bytes]:
        with self.path(file_id).open("rb") as f:
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


def _checked(file_id: str) -> str:
    """An id names a file in `root` and nothing outside it."""
    if not file_id.startswith("file-") or not file_id[5:].replace("-", "").isalnum():
        raise not_found("file", file_id)
    return file_id
