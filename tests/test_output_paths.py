"""No output path follows a symbolic link: `run`, `results` and `submit --wait` refuse a link
planted at the output, at the errors file beside it or at the download's marker, in one line and
with a non-zero exit, and the link's target is left as it was."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from services_testbed import MAX_MODEL_LEN, MODEL, RedisServer, batch_line, planner_in_process

from prefixgrove.cli import main
from prefixgrove.output_files import OutputPathRefused, open_output
from prefixgrove.planner.client import PlannerClient
from prefixgrove.settings import IngestSettings

VICTIM = "a file the link points at, which no command may touch\n"
VICTIM_FILE = "victim.txt"
# where a link is planted: the output and the default errors file beside it
PLANTED = ["out.jsonl", "out.errors.jsonl"]
# a download's outputs: those and its resume marker
DOWNLOAD_OUTPUTS = [*PLANTED, "out.jsonl.offset"]


class Planner(NamedTuple):
    client: PlannerClient
    address: str  # for the command line's --planner


def plant(tmp_path: Path, name: str) -> Path:
    """A link at `name` to a file holding VICTIM; returns the link."""
    victim = tmp_path / VICTIM_FILE
    victim.write_text(VICTIM)
    (tmp_path / name).symlink_to(victim)
    return tmp_path / name


def assert_refused(exit_code: int, capsys: pytest.CaptureFixture[str], link: Path) -> None:
    """A command refused the link at `link`: exit status 1, one line that names it, and the
    link's target as it was."""
    assert exit_code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"prefixgrove: error: {link} is a symbolic link (to "), err
    assert "never written through a link" in err and err.count("\n") == 1, err
    assert (link.parent / VICTIM_FILE).read_text() == VICTIM


def job(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text(batch_line("a", {"prompt": "hello", "max_tokens": 2}) + "\n")
    return path


@pytest.mark.parametrize("name", PLANTED)
@pytest.mark.parametrize("resume", [False, True])
def test_run_refuses_a_link_at_an_output_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, resume: bool
) -> None:
    link = plant(tmp_path, name)
    args = ["run", str(job(tmp_path)), "-o", str(tmp_path / "out.jsonl"), "--model", MODEL,
            "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN)]  # fmt: skip
    assert_refused(main([*args, "--resume"] if resume else args), capsys, link)


def test_run_refuses_one_file_for_both_outputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    args = ["run", str(job(tmp_path)), "-o", str(out), "--errors", str(out),
            "--model", MODEL, "--device", "cpu"]  # fmt: skip
    assert main(args) == 1
    assert "are the same file" in capsys.readouterr().err and not out.exists()


@pytest.fixture
def planner(redis_server: RedisServer) -> Iterator[Planner]:
    ingest = IngestSettings(max_model_len=MAX_MODEL_LEN)
    with planner_in_process(redis_server.url, ingest) as (server, client):
        yield Planner(client, f"127.0.0.1:{server.port}")


@pytest.mark.parametrize("name", DOWNLOAD_OUTPUTS)
def test_results_refuses_a_link_at_an_output_path(
    planner: Planner, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    submitted = planner.client.submit_file(job(tmp_path))
    link = plant(tmp_path, name)
    args = ["results", submitted.id, "-o", str(tmp_path / "out.jsonl"),
            "--planner", planner.address]  # fmt: skip
    assert_refused(main(args), capsys, link)


@pytest.mark.parametrize("name", DOWNLOAD_OUTPUTS)
def test_submit_wait_refuses_a_link_at_an_output_path_and_submits_nothing(
    planner: Planner, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    link = plant(tmp_path, name)
    args = ["submit", str(job(tmp_path)), "--wait", "-o", str(tmp_path / "out.jsonl"),
            "--planner", planner.address]  # fmt: skip
    assert_refused(main(args), capsys, link)
    assert planner.client.list() == []


def test_a_link_planted_after_the_check_is_refused_when_opened(tmp_path: Path) -> None:
    link = plant(tmp_path, "out.jsonl")
    with pytest.raises(OutputPathRefused, match="is a symbolic link"):
        open_output(link)
    assert (tmp_path / VICTIM_FILE).read_text() == VICTIM


def test_an_output_shorter_than_what_is_kept_is_refused_not_padded(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"one line\n")
    with pytest.raises(ValueError, match="holds 9 bytes, fewer than the 20 to keep"):
        open_output(out, keep=20)
    assert out.read_bytes() == b"one line\n"
