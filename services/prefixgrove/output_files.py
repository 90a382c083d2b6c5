"""Where a job's output files meet the disk: the output and error files of `prefixgrove run`,
`results` and `submit --wait`, a download's marker and any temporary file are opened here and
nowhere else, so that no output path follows a symbolic link.

A link at an output path is refused (`OutputPathRefused`, naming the path and where it points):
its target is never opened, written or truncated. Files are opened with O_NOFOLLOW, so a link
planted between the check and the open is refused all the same. Only the file itself is checked:
the folders above it may be links, as they often are (`/tmp`, a mounted volume).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

_READ_CHUNK = 1 << 20


class OutputPathRefused(OSError):
    """An output path that will not be written: a symbolic link, or two outputs on one file."""


def check_outputs(*paths: Path) -> None:
    """Refuses, before anything is written, output paths that are links or name one file twice."""
    seen: dict[Path, Path] = {}
    for path in paths:
        _refuse_link(path)
        same = seen.setdefault(path.resolve(), path)
        if same is not path:
            raise OutputPathRefused(
                f"{path} and {same} are the same file: give each output a path of its own"
            )


def open_output(path: Path, keep: int = 0) -> BinaryIO:
    """`path` for writing after its first `keep` bytes (cut there; 0: emptied), created where
    missing. A file shorter than `keep` is refused (ValueError), never padded."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _open(path, os.O_WRONLY | os.O_CREAT)
    try:
        size = os.fstat(fd).st_size
        if size < keep:
            raise ValueError(f"{path} holds {size} bytes, fewer than the {keep} to keep")
        if size > keep:
            os.ftruncate(fd, keep)
        os.lseek(fd, keep, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "wb")


def read_output(path: Path) -> bytes:
    """The whole file (b"" when there is none)."""
    return b"".join(read_chunks(path))


def read_chunks(path: Path, size: int | None = None) -> Iterator[bytes]:
    """The file's first `size` bytes (all of them: None; fewer when it is shorter), a chunk at a
    time; nothing when there is no file."""
    try:
        fd = _open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    with os.fdopen(fd, "rb") as f:
        while size is None or size > 0:
            chunk = f.read(_READ_CHUNK if size is None else min(size, _READ_CHUNK))
            if not chunk:
                return
            size = None if size is None else size - len(chunk)
            yield chunk


@contextmanager
def replaced(path: Path) -> Iterator[BinaryIO]:
    """A new file that takes `path`'s place when the block ends without an error, whole: it is
    written under a name the call creates itself in the same folder (never an existing path) and
    renamed over `path`, which replaces a link there rather than writing through it. Nothing of
    it is left when the block fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(partial, path)
    finally:
        Path(partial).unlink(missing_ok=True)


def _open(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError:
        _refuse_link(path)  # the clearer error when a link is why it failed (ELOOP)
        raise


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise OutputPathRefused(
            f"{path} is a symbolic link (to {os.readlink(path)}): an output is never written "
            "through a link; remove it or name another path"
        )
