"""An input's fingerprint: its request lines (the lines that are not blank, the ones a job counts)
counted and hashed in order, the same way by the client that sends them and by the planner that
holds them, so either can tell the whole input from part of it, or from another input.

Each request line, as sent, has a 16-byte BLAKE2b digest; the input's digest is the sha256 (hex) of
those digests one after another. The planner keeps each line's digest while the upload lasts
(jobs/redis_store/uploads.py), which lets it compare a line sent again with the one it holds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

LINE_DIGEST_BYTES = 16


def is_request_line(line: bytes) -> bool:
    """A blank line is no request: it takes no index (jobs/ingest.py skips it the same way)."""
    return bool(line.strip())


def line_digest(line: bytes) -> bytes:
    return hashlib.blake2b(line, digest_size=LINE_DIGEST_BYTES).digest()


class Fingerprint:
    """The fingerprint of the request lines added so far."""

    def __init__(self) -> None:
        self.lines = 0
        self._hash = hashlib.sha256()

    def add(self, line: bytes) -> None:
        if is_request_line(line):
            self.add_digests(line_digest(line))

    def add_digests(self, digests: bytes) -> None:
        """Lines already hashed: their digests one after another."""
        self.lines += len(digests) // LINE_DIGEST_BYTES
        self._hash.update(digests)

    @property
    def digest(self) -> str:
        return self._hash.hexdigest()


def fingerprint(lines: Iterable[bytes]) -> Fingerprint:
    found = Fingerprint()
    for line in lines:
        found.add(line)
    return found
