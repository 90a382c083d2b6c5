"""An output object is written as bounded parts beside its name and appears under it only when
committed, whole; a writer killed mid-upload is taken up again from the parts it left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from object_store_testbed import S3Server

from prefixgrove.output_files import open_outputs, read_output
from prefixgrove.storage.staged import PARTS_SUFFIX, StagedObject

PART = 64 << 10


def lines(first: int, last: int) -> bytes:
    return b"".join(b'{"line": %d, "pad": "%s"}\n' % (i, b"x" * 200) for i in range(first, last))


def test_nothing_is_visible_under_the_name_until_the_commit(s3: S3Server) -> None:
    bucket = s3.bucket()
    staged = StagedObject(f"s3://{bucket}/out.jsonl", PART)
    staged.start()
    staged.write(lines(0, 1000))
    staged.flush()
    assert "out.jsonl" not in s3.keys(bucket)
    assert any(k.startswith("out.jsonl" + PARTS_SUFFIX) for k in s3.keys(bucket))
    staged.commit()
    assert s3.keys(bucket) == ["out.jsonl"]
    assert s3.get(bucket, "out.jsonl") == lines(0, 1000)


def test_parts_are_bounded_and_the_commit_joins_them_in_order(s3: S3Server) -> None:
    bucket = s3.bucket()
    staged = StagedObject(f"s3://{bucket}/big.jsonl", PART)
    staged.start()
    for first in range(0, 3000, 100):  # a flush after every batch, as the run does after a step
        staged.write(lines(first, first + 100))
        staged.flush()
    sizes = [size for _, size in staged.staged_parts()]
    assert len(sizes) >= 10 and max(sizes) < PART + 100 * 230
    staged.commit()
    assert s3.get(bucket, "big.jsonl") == lines(0, 3000)


def test_a_failed_block_keeps_its_parts_and_commits_nothing(s3: S3Server) -> None:
    bucket = s3.bucket()
    out, err = f"s3://{bucket}/o.jsonl", f"s3://{bucket}/o.errors.jsonl"
    with pytest.raises(KeyboardInterrupt), open_outputs(out, err) as (o, e):
        o.write(lines(0, 10))
        e.write(b"error line\n")
        raise KeyboardInterrupt
    assert "o.jsonl" not in s3.keys(bucket)
    assert read_output(out) == lines(0, 10) and read_output(err) == b"error line\n"


def test_a_resume_keeps_the_bytes_asked_for_even_inside_a_part(s3: S3Server) -> None:
    bucket = s3.bucket()
    url = f"s3://{bucket}/r.jsonl"
    first = StagedObject(url, PART)
    first.start()
    first.write(lines(0, 900))
    first.checkpoint()
    keep = len(lines(0, 500))
    again = StagedObject(url, PART)
    again.start(keep)
    again.write(lines(500, 600))
    again.commit()
    assert s3.get(bucket, "r.jsonl") == lines(0, 600)
    assert s3.keys(bucket) == ["r.jsonl"]


def test_a_resume_over_a_committed_object_goes_on_after_it(s3: S3Server) -> None:
    bucket = s3.bucket()
    url = f"s3://{bucket}/done.jsonl"
    s3.put(bucket, "done.jsonl", lines(0, 50))
    assert read_output(url) == lines(0, 50)
    again = StagedObject(url, PART)
    again.start(len(lines(0, 40)))
    again.write(lines(40, 60))
    again.commit()
    assert s3.get(bucket, "done.jsonl") == lines(0, 60)


WRITER = textwrap.dedent(
    """
    import sys, time
    sys.path[:0] = [sys.argv[2], sys.argv[2] + "/.."]
    from test_staged_objects import lines
    from prefixgrove.storage.staged import StagedObject
    staged = StagedObject(sys.argv[1], 64 << 10)
    staged.start()
    for first in range(0, 100_000, 100):
        staged.write(lines(first, first + 100))
        staged.flush()
        if len(staged.staged_parts()) >= 4:
            print("parts", flush=True)
            time.sleep(60)
    """
)


def test_a_writer_killed_mid_upload_is_resumed_from_its_parts(s3: S3Server, tmp_path: Path) -> None:
    """SIGKILL leaves parts and no object; a new writer keeps every whole line of them (the
    judge of a resumed run decides how many: here all) and commits the rest after them."""
    bucket = s3.bucket()
    url = f"s3://{bucket}/killed.jsonl"
    here = str(Path(__file__).parent)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, url, here], stdout=subprocess.PIPE,
                            env=os.environ.copy())  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == b"parts\n"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert "killed.jsonl" not in s3.keys(bucket)
    left = read_output(url)
    count = left.count(b"\n")
    assert left == lines(0, count) and count >= 4 * (PART // 230)
    again = StagedObject(url, PART)
    again.start(len(left))
    again.write(lines(count, count + 500))
    again.commit()
    assert s3.get(bucket, "killed.jsonl") == lines(0, count + 500)
