"""What an object-storage URL names. A path without a scheme is a local file, as before; a URL
with a scheme other than s3:// or gs:// is refused, naming the schemes served."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SCHEMES = {"s3": "S3 or an S3-compatible store", "gs": "Google Cloud Storage"}


class StorageError(OSError):
    """An object could not be read or written; the message names its URL and the cause."""


def is_url(source: str | Path) -> bool:
    """Whether `source` names an object by URL (`scheme://...`) rather than a local path."""
    return isinstance(source, str) and "://" in source


def source_arg(text: str) -> str | Path:
    """An argparse `type`: a URL stays text (Path would fold its `//`), anything else a Path."""
    return text if is_url(text) else Path(text)


@dataclass(frozen=True)
class ObjectLocation:
    scheme: str  # "s3" or "gs"
    bucket: str
    key: str

    @classmethod
    def parse(cls, url: str) -> ObjectLocation:
        scheme, _, rest = url.partition("://")
        if scheme not in SCHEMES:
            served = ", ".join(f"{s}:// ({what})" for s, what in SCHEMES.items())
            raise StorageError(f"{url}: the scheme {scheme}:// is not served; use {served}")
        bucket, _, key = rest.partition("/")
        if not bucket:
            raise StorageError(f"{url}: no bucket; expected {scheme}://BUCKET/KEY")
        if not key or key.endswith("/"):
            raise StorageError(
                f"{url}: no object key after the bucket; expected {scheme}://BUCKET/KEY"
            )
        return cls(scheme, bucket, key)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"

    def sibling(self, suffix: str) -> ObjectLocation:
        """The object whose key is this one's with `suffix` appended."""
        return ObjectLocation(self.scheme, self.bucket, self.key + suffix)


def errors_beside(output: str | Path) -> str | Path:
    """Where a job's error lines go by default: OUTPUT with `.errors.jsonl` for its suffix."""
    if not is_url(output):
        path = Path(output)
        return path.with_name(path.stem + ".errors.jsonl")
    text = str(output)
    head, _, name = text.rpartition("/")
    stem = name.rsplit(".", 1)[0] if "." in name else name
    return f"{head}/{stem}.errors.jsonl"
