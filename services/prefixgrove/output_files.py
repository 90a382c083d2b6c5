"""Where a job's output files meet the disk: the output and error files of `prefixgrove run`,
`results` and `submit --wait`, a download's marker and any temporary file are opened here and
nowhere else, so that no output path follows a symbolic link.

A link at an output path is refused (`OutputPathRefused`, naming the path and where it points):
its target is never opened, written or truncated. Files are opened with O_NOFOLLOW, so a link
planted between the check and the open is refused all the same. Only the file itself is checked:
the folders above it may be links, as they often are (`/tmp`, a mounted volume).

An output named by URL (s3://, gs://) has no link to refuse: it is staged as parts and committed
whole at the end (prefixgrove/storage/staged.py), and read back from its parts for a resume.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import BinaryIO, cast

from prefixgrove import settings as cfg
from prefixgrove.settings import StorageSettings
from prefixgrove.storage import objects
from prefixgrove.storage.locations import ObjectLocation, is_url
from prefixgrove.storage.staged import StagedObject, staged_pair

_READ_CHUNK = 1 << 20


class OutputPathRefused(OSError):
    """An output path that will not be written: a symbolic link, or two outputs on one file."""


def check_outputs(*paths: Path | str) -> None:
    """Refuses, before anything is written, output paths that are links or name one file twice,
    and URLs that name no object or whose bucket cannot be reached (missing, access denied)."""
    seen: dict[Path | str, Path | str] = {}
    for path in paths:
        if is_url(path):
            location = ObjectLocation.parse(str(path))
            objects.size_of(
                location
            )  # a missing bucket or refused credentials: now, not at the end
            resolved: Path | str = location.url
        else:
            _refuse_link(Path(path))
            resolved = Path(path).resolve()
        same = seen.setdefault(resolved, path)
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


def read_output(path: Path | str) -> bytes:
    """The whole file (b"" when there is none); of an object, what its writer left."""
    if is_url(path):
        return b"".join(StagedObject(str(path), _part_bytes()).written())
    return b"".join(read_chunks(Path(path)))


@contextmanager
def open_outputs(
    output: Path | str, errors: Path | str, keep: tuple[int, int] = (0, 0)
) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """A job's two outputs for writing after their first `keep` bytes (open_output). Objects are
    committed when the block ends without an error; after one, what they hold is uploaded as
    parts, so a resume goes on from there."""
    staged = _staged(output, errors)
    with ExitStack() as files:
        handles = []
        for side, path in enumerate((output, errors)):
            if staged[side] is None:
                handles.append(files.enter_context(open_output(Path(path), keep[side])))
            else:
                cast(StagedObject, staged[side]).start(keep[side])
                handles.append(cast(BinaryIO, staged[side]))
        try:
            yield handles[0], handles[1]
        except BaseException:
            _keep_parts(staged)
            raise
    for obj in staged:
        if obj is not None:
            obj.commit()


def _staged(output: Path | str, errors: Path | str) -> list[StagedObject | None]:
    part_bytes = _part_bytes()
    if is_url(output) and is_url(errors):
        return list(staged_pair(str(output), str(errors), part_bytes))
    return [StagedObject(str(p), part_bytes) if is_url(p) else None for p in (output, errors)]


def _keep_parts(staged: list[StagedObject | None]) -> None:
    """Uploads what the writers hold, so that a resume need not run it again; a store that
    cannot take it now loses only those lines (they run again)."""
    for obj in staged:
        if obj is None:
            continue
        try:
            obj.checkpoint()
        except OSError as exc:
            import logging

            logging.getLogger(__name__).warning("%s: the last part was not kept: %s", obj.url, exc)


def _part_bytes() -> int:
    return cfg.load(StorageSettings).object_part_bytes


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
