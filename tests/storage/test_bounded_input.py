"""An input object is read in bounded chunks, never held whole: a 1 GiB input (made lazily, chunk
by chunk, so that neither the disk nor the store holds it) goes through the lines reader with the
process's Python allocations bounded; a real object read from the server grows the reading
process by far less than its size."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tracemalloc
from collections.abc import Iterator

import pytest
from object_store_testbed import S3Server

from prefixgrove.input_lines import line_batches
from prefixgrove.storage import objects

GIB = 1 << 30
LINE = b'{"custom_id": "x", "pad": "' + b"y" * (256 << 10) + b'"}\n'


def lazy_object(total: int, chunk: int = 1 << 20) -> Iterator[bytes]:
    """`total` bytes of whole lines (cut down to a whole line), a chunk of about `chunk` bytes at a
    time: the only copy is the chunk in flight."""
    per_chunk = max(1, chunk // len(LINE))
    left = total // len(LINE)
    while left:
        yield LINE * min(per_chunk, left)
        left -= min(per_chunk, left)


def test_a_1_gib_input_streams_through_the_lines_reader_in_bounded_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(objects, "stream", lambda location, chunk, start=0: lazy_object(GIB))
    tracemalloc.start()
    try:
        count = size = 0
        for batch in line_batches("s3://bucket/huge.jsonl", 1 << 20, 64, 4 << 20):
            count += len(batch)
            size += sum(len(line) + 1 for line in batch)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == GIB // len(LINE) and size == count * len(LINE) > GIB - len(LINE)
    assert peak < 24 << 20, f"peak {peak >> 20} MiB of Python allocations for a 1 GiB input"


READER = textwrap.dedent(
    """
    import resource, sys
    from prefixgrove.input_lines import line_batches
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lines = sum(len(b) for b in line_batches(sys.argv[1], 1 << 20, 4096))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(lines, (after - before) // 1024)
    """
)


def test_an_object_read_from_the_store_grows_the_reader_by_far_less_than_its_size(
    s3: S3Server,
) -> None:
    bucket = s3.bucket()
    data = b"".join(lazy_object(128 << 20))
    s3.put(bucket, "big.jsonl", data)
    done = subprocess.run([sys.executable, "-c", READER, f"s3://{bucket}/big.jsonl"],
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    lines, grew_mib = (int(v) for v in done.stdout.split())
    assert lines == data.count(b"\n")
    assert grew_mib < 48, f"reading a 128 MiB object grew the process by {grew_mib} MiB"
