"""Objects read as streams of bounded chunks, written whole when small, listed and deleted; every
error leaves as a StorageError that names the URL and the cause (stores.py)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any, BinaryIO

from prefixgrove.storage.locations import ObjectLocation
from prefixgrove.storage.stores import storage_error, store_for

READ_CHUNK = 1 << 20  # bytes asked of the store at a time while streaming an object


def open_input(url: str, chunk: int = READ_CHUNK) -> BinaryIO:
    """The object for reading, in order, holding at most about `chunk` bytes of it at a time
    (readline(limit) works as on a file: input_lines.py reads its lines through it)."""
    location = ObjectLocation.parse(url)
    raw = _ChunkStream(location, stream(location, chunk))
    return io.BufferedReader(raw, buffer_size=chunk)


def stream(location: ObjectLocation, chunk: int = READ_CHUNK, start: int = 0) -> Iterator[bytes]:
    """The object's bytes from `start` on, about `chunk` at a time."""
    import obstore

    options: Any = {"range": {"offset": start}} if start else None
    try:
        result = obstore.get(store_for(location), location.key, options=options)
        for data in result.stream(min_chunk_size=chunk):
            yield bytes(data)
    except Exception as exc:
        raise storage_error(exc, location.url, "reading") from None


def read_range(location: ObjectLocation, start: int, end: int) -> bytes:
    """Bytes [start, end) of the object."""
    import obstore

    if end <= start:
        return b""
    try:
        return bytes(obstore.get_range(store_for(location), location.key, start=start, end=end))
    except Exception as exc:
        raise storage_error(exc, location.url, "reading") from None


def put(location: ObjectLocation, data: bytes) -> None:
    """Writes the object whole in one request: it appears complete or not at all."""
    import obstore

    try:
        obstore.put(store_for(location), location.key, data)
    except Exception as exc:
        raise storage_error(exc, location.url, "writing") from None


def size_of(location: ObjectLocation) -> int | None:
    """The object's size in bytes; None when there is no such object (the bucket must exist)."""
    import obstore
    from obstore import exceptions as obx

    store = store_for(location)
    refused: Exception | None = None
    try:
        return int(obstore.head(store, location.key)["size"])
    except (FileNotFoundError, obx.NotFoundError):
        pass
    except Exception as exc:
        refused = exc
    # NOTE: a HEAD answer has no body to say why (no such bucket, wrong credentials, ...): a
    # list of the same key asks the same store, and its answer has one
    try:
        next(iter(obstore.list(store, location.key, chunk_size=1)), None)
    except Exception as exc:
        raise storage_error(exc, location.url, "looking up") from None
    if refused is not None:
        raise storage_error(refused, location.url, "looking up") from None
    return None


def listed(prefix: ObjectLocation) -> list[tuple[str, int]]:
    """(key, size) of every object whose key starts with `prefix.key`, sorted by key."""
    import obstore

    found: list[tuple[str, int]] = []
    try:
        for page in obstore.list(store_for(prefix), prefix.key):
            found += [(str(meta["path"]), int(meta["size"])) for meta in page]
    except Exception as exc:
        raise storage_error(exc, prefix.url, "listing") from None
    return sorted(found)


def delete(location: ObjectLocation) -> None:
    import obstore

    try:
        obstore.delete(store_for(location), location.key)
    except Exception as exc:
        raise storage_error(exc, location.url, "deleting") from None


def copy(source: ObjectLocation, target: ObjectLocation) -> None:
    """A copy made by the store itself: no byte of it passes through this process."""
    import obstore

    try:
        obstore.copy(store_for(source), source.key, target.key)
    except Exception as exc:
        raise storage_error(exc, target.url, f"copying {source.url} to") from None


class _ChunkStream(io.RawIOBase):
    """A raw stream over an iterator of chunks, for io.BufferedReader."""

    def __init__(self, location: ObjectLocation, chunks: Iterator[bytes]) -> None:
        self.location, self._chunks, self._held = location, chunks, memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if not self._held:
            self._held = memoryview(next(self._chunks, b""))
        n = min(len(buffer), len(self._held))
        buffer[:n] = self._held[:n]
        self._held = self._held[n:]
        return n
