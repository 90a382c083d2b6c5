"""Raw HTTP calls on the planner's OpenAI Batch API, for what the SDK would never send: uploads
streamed from a file of any size (or held open midway), malformed bodies, odd query strings."""

from __future__ import annotations

import http.client
import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


@dataclass
class Answer:
    status: int
    body: Any  # the JSON answer


def call(port: int, method: str, path: str, body: Any = None, headers: dict | None = None,
         token: str | None = None) -> Answer:  # fmt: skip
    """One request; `body` as given (bytes, or an iterable of bytes streamed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        sent = dict(headers or {})
        if token:
            sent["Authorization"] = f"Bearer {token}"
        conn.request(method, path, body=body, headers=sent)
        answer = conn.getresponse()
        return Answer(answer.status, json.loads(answer.read() or b"null"))
    finally:
        conn.close()


class MultipartUpload:
    """A `/v1/files` upload streamed from `path` a chunk at a time; `pause_after` bytes of the
    file in, it waits until `resume` is set."""

    def __init__(self, path: Path, purpose: str = "batch", pause_after: int | None = None) -> None:
        self.path = path
        self.boundary = uuid.uuid4().hex
        self.head = (
            f'--{self.boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'
            f'{purpose}\r\n--{self.boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="{path.name}"\r\nContent-Type: application/octet-stream\r\n\r\n'
        ).encode()
        self.tail = f"\r\n--{self.boundary}--\r\n".encode()
        self.pause_after = pause_after
        self.resume = threading.Event()

    @property
    def headers(self) -> dict[str, str]:
        size = len(self.head) + self.path.stat().st_size + len(self.tail)
        return {"Content-Type": f"multipart/form-data; boundary={self.boundary}",
                "Content-Length": str(size)}  # fmt: skip

    def body(self) -> Iterator[bytes]:
        yield self.head
        sent = 0
        with self.path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                if self.pause_after is not None and sent >= self.pause_after:
                    self.resume.wait()
                yield chunk
                sent += len(chunk)
        yield self.tail

    def send(self, port: int, token: str | None = None) -> Answer:
        return call(port, "POST", "/v1/files", self.body(), self.headers, token)
