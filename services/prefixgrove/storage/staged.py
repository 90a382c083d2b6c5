"""An output object written as bounded parts and committed atomically under its own name.

While it is written, an output `s3://b/out.jsonl` lives as parts beside it, each one object
written whole in one request: `s3://b/out.jsonl.prefixgrove-parts/part-000001`, `...-000002`, ...
The writer holds at most about one part in memory; `flush` uploads a part once it holds
`part_bytes`, and a writer paired with another (a job's output and error files) makes the other
upload what it holds too, so the two stay close and a resume keeps what both answer. A kill
loses only what was not uploaded yet: the parts listed are exactly what was written, in order.

`commit` makes the object: one part is copied by the store itself, several are streamed into one
multipart upload that the store completes at its end (the parts pass through this process once
more, a chunk at a time); either way the object appears whole under its name or not at all. Then
the parts are deleted. A resumed writer (`start(keep)`) keeps the first `keep` bytes of what the
parts hold (or, with none, of the committed object) and goes on after them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prefixgrove.storage import objects
from prefixgrove.storage.locations import ObjectLocation
from prefixgrove.storage.stores import storage_error, store_for

log = logging.getLogger(__name__)
PARTS_SUFFIX = ".prefixgrove-parts/"
_MULTIPART_BUFFER = 8 << 20  # the commit's own upload parts (S3 wants 5 MiB at least)


class StagedObject:
    def __init__(self, url: str, part_bytes: int) -> None:
        self.location = ObjectLocation.parse(url)
        self.part_bytes = part_bytes
        self.partner: StagedObject | None = None
        self._parts: list[tuple[str, int]] = []  # (key, size) uploaded, in order
        self._buffer = bytearray()

    @property
    def url(self) -> str:
        return self.location.url

    def _prefix(self) -> ObjectLocation:
        return self.location.sibling(PARTS_SUFFIX)

    def _part(self, key: str) -> ObjectLocation:
        return ObjectLocation(self.location.scheme, self.location.bucket, key)

    def staged_parts(self) -> list[tuple[str, int]]:
        return objects.listed(self._prefix())

    def written(self) -> Iterator[bytes]:
        """What an earlier writer left: its parts in order, else the committed object (if any)."""
        parts = self.staged_parts()
        if parts:
            for key, _ in parts:
                yield from objects.stream(self._part(key))
        elif objects.size_of(self.location) is not None:
            yield from objects.stream(self.location)

    def start(self, keep: int = 0) -> None:
        """Goes on after the first `keep` bytes of what was written (0: starts empty, dropping
        any parts); a `keep` past what was written is refused (ValueError), never padded."""
        parts = self.staged_parts()
        if not parts and keep:
            parts = self._adopt_committed(keep)
        total = sum(size for _, size in parts)
        if total < keep:
            raise ValueError(f"{self.url} holds {total} bytes, fewer than the {keep} to keep")
        done = 0
        for number, (key, size) in enumerate(parts):
            if done + size <= keep:
                self._parts.append((key, size))
                done += size
                continue
            if done < keep:  # the part that straddles `keep`: its head is held again
                self._buffer += objects.read_range(self._part(key), 0, keep - done)
                done = keep
            for dropped, _ in parts[number:]:
                objects.delete(self._part(dropped))
            break

    def _adopt_committed(self, keep: int) -> list[tuple[str, int]]:
        """Turns the first `keep` bytes of the committed object into parts: the whole object by
        the store's own copy, a head of it a part at a time."""
        size = objects.size_of(self.location) or 0
        if size < keep:
            raise ValueError(f"{self.url} holds {size} bytes, fewer than the {keep} to keep")
        if size == keep:
            first = self._part_key(1)
            objects.copy(self.location, self._part(first))
            return [(first, size)]
        for start in range(0, keep, self.part_bytes):
            end = min(start + self.part_bytes, keep)
            self._buffer += objects.read_range(self.location, start, end)
            self._upload()
        made, self._parts = self._parts, []
        return made

    def write(self, data: bytes) -> int:
        self._buffer += data
        return len(data)

    def flush(self) -> None:
        """Uploads a part once one is full (and the partner's, so that both go forward)."""
        if len(self._buffer) >= self.part_bytes:
            self.checkpoint()

    def checkpoint(self) -> None:
        """Uploads what this writer and its partner hold, each as a part of its own."""
        self._upload()
        if self.partner is not None:
            self.partner._upload()

    def _part_key(self, number: int) -> str:
        return f"{self._prefix().key}part-{number:06d}"

    def _upload(self) -> None:
        if not self._buffer:
            return
        key = self._part_key(len(self._parts) + 1)
        objects.put(self._part(key), bytes(self._buffer))
        self._parts.append((key, len(self._buffer)))
        self._buffer.clear()

    def commit(self) -> None:
        """Makes the object whole under its name, then deletes the parts."""
        if not self._parts:
            objects.put(self.location, bytes(self._buffer))
        elif len(self._parts) == 1 and not self._buffer:
            objects.copy(self._part(self._parts[0][0]), self.location)
        else:
            self._concatenate()
        for key, _ in self._parts:
            objects.delete(self._part(key))
        self._parts, self._buffer = [], bytearray()

    def _concatenate(self) -> None:
        import obstore

        store = store_for(self.location)
        try:
            with obstore.open_writer(store, self.location.key, buffer_size=_MULTIPART_BUFFER) as f:
                for key, _ in self._parts:
                    for chunk in objects.stream(self._part(key)):
                        f.write(chunk)
                f.write(bytes(self._buffer))
        except Exception as exc:
            raise storage_error(exc, self.url, "committing") from None


def staged_pair(output: str, errors: str, part_bytes: int) -> tuple[StagedObject, StagedObject]:
    """A job's output and error objects, each uploading a part when the other does."""
    out, err = StagedObject(output, part_bytes), StagedObject(errors, part_bytes)
    out.partner, err.partner = err, out
    return out, err
