"""`prefixgrove results` and PlannerClient.download resume an interrupted download only from what
they can verify, else start over: against a real planner and redis-server, whatever happened to
the files or the marker in between, the files end whole, equal to one uninterrupted download."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from polling import wait_for
from services_testbed import MODEL, RedisServer, batch_line, planner_in_process

from prefixgrove.cli import main
from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.queue import GroupQueue
from prefixgrove.jobs.redis_store.schema import JobState, ResultRecord
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.planner.client import PlannerClient, PlannerUnavailable
from prefixgrove.planner.download import download, marker_path
from prefixgrove.settings import IngestSettings
from prefixgrove_proto import planner_pb2 as pb

LINES = 40  # every seventh does not parse: both files get lines


def job_lines() -> list[bytes]:
    return [
        b"{not json" if i % 7 == 3 else batch_line(f"r{i}", {"prompt": f"item {i}"}).encode()
        for i in range(LINES)
    ]


def answer_every_request(redis_url: str, job_id: str) -> None:
    """What a worker would do, without a model: each request answered by a line naming it."""
    store = JobStore(connect(redis_url))
    queue = GroupQueue(store.r, MODEL, "w1", lease_timeout_s=60)

    def work() -> bool:
        for lease in queue.take(8, block_ms=100):
            loaded = store.load_group(lease.job_id, lease.group_id)
            assert loaded is not None
            group, records = loaded
            store.mark_leased(lease.job_id, lease.group_id)
            results = [
                (i, ResultRecord(False, json.dumps({"custom_id": r.custom_id, "n": i})), 1)
                for i, r in zip(group.indices, records, strict=True)
            ]
            store.write_results(lease.job_id, results)
            store.finish_group(lease.job_id, lease.group_id)
            queue.ack(lease)
        return store.job_state(job_id) == JobState.COMPLETED

    wait_for(f"job {job_id} to complete", work, 60, every=0)


class Planner:
    """A planner (in this process) over a real redis-server, with one job answered whole, and
    the files one uninterrupted download of it gives."""

    def __init__(self, client: PlannerClient, port: int, job_id: str, whole: Path) -> None:
        self.client, self.port, self.job_id = client, port, job_id
        self.output, self.errors = whole / "out.jsonl", whole / "out.errors.jsonl"
        client.download(job_id, self.output, self.errors)

    def results_command(self, output: Path) -> int:
        return main(["results", self.job_id, "-o", str(output), "--planner",
                     f"127.0.0.1:{self.port}", "--json"])  # fmt: skip

    def interrupted(self, output: Path, after: int, stop: BaseException | None = None) -> None:
        """A download of the job into `output` that stops `after` result lines, as a planner
        that goes away (or Ctrl-C) stops it."""
        stop = stop or PlannerUnavailable(grpc.StatusCode.UNAVAILABLE, "the planner went away")

        def results(offset: int) -> Iterator[pb.ResultLine]:
            stream = self.client.results(self.job_id, offset, pb.RESULT_KIND_ALL, follow=True)
            for n, line in enumerate(stream):
                if n == after:
                    raise stop
                yield line

        with pytest.raises(type(stop)):
            download(results, self.job_id, output, errors_of(output))

    def same_as_whole(self, output: Path) -> bool:
        return (output.read_bytes(), errors_of(output).read_bytes()) == (
            self.output.read_bytes(),
            self.errors.read_bytes(),
        )


def errors_of(output: Path) -> Path:
    return output.with_name(output.stem + ".errors.jsonl")


@pytest.fixture
def planner(redis_server: RedisServer, tmp_path: Path) -> Iterator[Planner]:
    with planner_in_process(redis_server.url, IngestSettings(max_model_len=512)) as (server, c):
        job = c.submit_file(_write(tmp_path / "in.jsonl", job_lines()))
        answer_every_request(redis_server.url, job.id)
        yield Planner(c, server.port, job.id, tmp_path / "whole")


def _write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def test_an_interrupted_download_leaves_a_marker_at_its_last_whole_line(
    planner: Planner, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    planner.interrupted(out, after=15)
    marker = json.loads(marker_path(out).read_text())
    assert marker["job"] == planner.job_id and marker["next"] == 15
    lines = out.read_bytes().count(b"\n") + errors_of(out).read_bytes().count(b"\n")
    assert lines == 15 == marker["output"]["lines"] + marker["errors"]["lines"]
    assert marker["output"]["size"] == out.stat().st_size


def test_a_download_stopped_before_its_first_line_leaves_no_marker(
    planner: Planner, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    planner.interrupted(out, after=0)
    assert not marker_path(out).exists()
    assert out.read_bytes() == errors_of(out).read_bytes() == b""


def test_a_download_stopped_by_ctrl_c_resumes_where_it_stopped(
    planner: Planner, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    planner.interrupted(out, after=15, stop=KeyboardInterrupt())
    assert planner.results_command(out) == 0
    said = capsys.readouterr().err
    assert "resuming the download of job" in said and "not resuming" not in said
    assert planner.same_as_whole(out) and not marker_path(out).exists()


def test_lines_written_after_the_marker_are_downloaded_again(
    planner: Planner, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A download killed outright leaves lines past its last marker, the last one torn."""
    out = tmp_path / "out.jsonl"
    planner.interrupted(out, after=10)
    older = marker_path(out).read_bytes()
    planner.interrupted(out, after=12)  # goes on to line 22
    marker_path(out).write_bytes(older)
    with errors_of(out).open("ab") as err:
        err.write(b'{"id": "batch_req_torn')
    assert planner.results_command(out) == 0
    assert "resuming the download of job" in capsys.readouterr().err
    assert planner.same_as_whole(out)


def cut_short(out: Path) -> None:
    """The file shorter than the marker says: it lost its last line and a half."""
    data = out.read_bytes()
    out.write_bytes(data[: data.rindex(b"\n", 0, len(data) - 1) - 5])


def edit_a_line(out: Path) -> None:
    """A line changed in place, the size the same."""
    out.write_bytes(out.read_bytes().replace(b'"n": 1}', b'"n": 9}', 1))


def lose_the_errors_file(out: Path) -> None:
    errors_of(out).unlink()


def old_marker(out: Path) -> None:
    """A marker of the version before, which names sizes and no digests."""
    marker = json.loads(marker_path(out).read_text())
    size = marker["output"]["size"]
    marker_path(out).write_text(f"{marker['job']} {marker['next']} {size} 0")


def garbled_marker(out: Path) -> None:
    marker_path(out).write_text('{"job": "')


@pytest.mark.parametrize(
    "damage", [cut_short, edit_a_line, lose_the_errors_file, old_marker, garbled_marker]
)
def test_a_download_it_cannot_verify_starts_over(
    planner: Planner,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: Callable[[Path], None],
) -> None:
    out = tmp_path / "out.jsonl"
    planner.interrupted(out, after=20)
    damage(out)
    assert planner.results_command(out) == 0
    assert f"downloading job {planner.job_id} from its first line" in capsys.readouterr().err
    assert planner.same_as_whole(out)
    assert b"\0" not in out.read_bytes() + errors_of(out).read_bytes()


def test_a_marker_of_another_job_is_refused_and_the_files_are_left_alone(
    planner: Planner, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    planner.interrupted(out, after=20)
    marker = json.loads(marker_path(out).read_text())
    marker_path(out).write_text(json.dumps({**marker, "job": "job_other"}))
    before = out.read_bytes(), errors_of(out).read_bytes()
    assert planner.results_command(out) == 2
    err = capsys.readouterr().err
    assert "belongs to an interrupted download of job job_other" in err and err.count("\n") == 1
    assert (out.read_bytes(), errors_of(out).read_bytes()) == before
