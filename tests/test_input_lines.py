"""A batch file's lines are read in bounded memory: an over-long line is cut, never held whole,
and fails alone as line_too_large; the local run over a 1 GiB line stays within a memory ceiling."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from services_testbed import MAX_MODEL_LEN, MODEL, batch_line, service_env

from prefixgrove.input_lines import bounded_lines, line_batches
from prefixgrove.jobs.requests import parse_line

LIMIT = 16
GIB = 1 << 30
CEILING = 256 << 20  # what reading a 1 GiB line may add to a process's peak memory, at most


def lines_of(data: bytes, limit: int = LIMIT) -> list[bytes]:
    return list(bounded_lines(io.BytesIO(data), limit))


def test_lines_come_without_their_line_ends() -> None:
    assert lines_of(b"a\nbb\r\n\nccc") == [b"a", b"bb", b"", b"ccc"]


def test_a_line_of_the_limit_is_whole_with_either_line_end() -> None:
    line = b"x" * LIMIT
    assert lines_of(line + b"\r\n" + line + b"\n" + line) == [line] * 3


def test_a_line_over_the_limit_is_cut_and_the_next_line_keeps_its_place() -> None:
    long = b"y" * (LIMIT * 1000)
    assert lines_of(b"a\n" + long + b"\nb\n") == [b"a", long[: LIMIT + 1], b"b"]
    assert lines_of(b"a\n" + long) == [b"a", long[: LIMIT + 1]]  # the last, with no line end


def test_a_cut_line_fails_as_line_too_large() -> None:
    [cut] = lines_of(json.dumps({"custom_id": "x" * 100}).encode())
    error = parse_line(cut, 0, max_line_bytes=LIMIT, default_max_tokens=16)
    assert error.code == "line_too_large"  # type: ignore[union-attr]


def test_a_cut_line_that_starts_blank_is_not_taken_for_a_blank_line() -> None:
    [cut] = lines_of(b" " * (LIMIT + 5) + b'{"custom_id": "late"}')
    assert len(cut) == LIMIT + 1 and cut.strip()


def test_batches_end_at_their_line_count_or_their_size(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(b"%05d\n" % i for i in range(10)))
    assert [len(b) for b in line_batches(path, LIMIT, max_lines=4)] == [4, 4, 2]
    assert [len(b) for b in line_batches(path, LIMIT, max_lines=100, max_bytes=15)] == [3, 3, 3, 1]
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert list(line_batches(tmp_path / "empty.jsonl", LIMIT, max_lines=4)) == []


def huge_line_input(path: Path, size: int = GIB) -> Path:
    """Two requests around a line of `size` bytes with no line end in it (a sparse file: the
    line's bytes are NULs on no disk)."""
    first = batch_line("before", {"prompt": "Say one", "max_tokens": 2}).encode() + b"\n"
    last = b"\n" + batch_line("after", {"prompt": "Say two", "max_tokens": 2}).encode() + b"\n"
    with path.open("wb") as f:
        f.write(first)
        f.seek(len(first) + size)
        f.write(last)
    return path


def test_the_local_run_over_a_1gib_line_stays_within_the_ceiling(tmp_path: Path) -> None:
    """The run's peak memory over a 1 GiB line exceeds that over the same job without it by less
    than CEILING; the line fails alone, the others are answered."""
    small = tmp_path / "small.jsonl"
    small.write_text(
        batch_line("before", {"prompt": "Say one", "max_tokens": 2})
        + "\n"
        + batch_line("after", {"prompt": "Say two", "max_tokens": 2})
        + "\n"
    )
    baseline = peak_of_local_run(small, tmp_path / "small")
    peak = peak_of_local_run(huge_line_input(tmp_path / "huge.jsonl"), tmp_path / "huge")
    assert peak - baseline < CEILING, f"the run's peak grew by {peak - baseline} bytes"
    outputs = (tmp_path / "huge" / "out.jsonl").read_text().splitlines()
    assert [json.loads(line)["custom_id"] for line in outputs] == ["before", "after"]
    [error] = (tmp_path / "huge" / "out.errors.jsonl").read_text().splitlines()
    assert json.loads(error)["error"]["code"] == "line_too_large"


# A process whose only child is the run: its children's peak memory is the run's.
_PEAK = (
    "import resource, subprocess, sys; "
    "run = subprocess.run(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); "
    "sys.exit(run.returncode)"
)


def peak_of_local_run(job: Path, d: Path) -> int:
    """`prefixgrove run` of `job` into `d`: its peak resident memory in bytes."""
    d.mkdir()
    run = [sys.executable, "-m", "prefixgrove.cli", "run", str(job), "-o", str(d / "out.jsonl"),
           "--errors", str(d / "out.errors.jsonl"), "--model", MODEL, "--device", "cpu",
           "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--quiet"]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _PEAK, *run], env=service_env(),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.split()[-1])
