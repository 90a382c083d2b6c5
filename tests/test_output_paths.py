"""No output path follows a symbolic link: `run`, `results` and `submit --wait` refuse a link
planted at the output, at the errors file beside it or at the download's marker, in one line and
with a non-zero exit, and the link's target is left as it was."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from services_testbed import MAX_MODEL_LEN, MODEL, RedisServer, batch_line, planner_in_process

from prefixgrove.cli import main
from prefixgrove.output_files import OutputPathRefused, open_output
from prefixgrove.planner.client import PlannerClient
from prefixgrove.settings import IngestSettings

VICTIM = "a file the link points at, which no command may touch\n"
# where a link is planted: the output and the default errors file beside it
PLANTED = ["out.jsonl", "out.errors.jsonl"]


def plant(tmp_path: Path, name: str) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM)
    (tmp_path / name).symlink_to(victim)
    return victim


def refused_in_one_line(err: str, link: Path) -> bool:
    return (
        err.startswith(f"prefixgrove: error: {link} is a symbolic link (to ")
        and "never written through a link" in err
        and err.count("\n") == 1
    )


def job(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text(batch_line("a", {"prompt": "hello", "max_tokens": 2}) + "\n")
    return path


@pytest.mark.parametrize("name", PLANTED)
@pytest.mark.parametrize("resume", [False, True])
def test_run_refuses_a_link_at_an_output_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, resume: bool
) -> None:
    victim = plant(tmp_path, name)
    args = ["run", str(job(tmp_path)), "-o", str(tmp_path / "out.jsonl"), "--model", MODEL,
            "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN)]  # fmt: skip
    assert main([*args, "--resume"] if resume else args) == 1
    assert refused_in_one_line(capsys.readouterr().err, tmp_path / name)
    assert victim.read_text() == VICTIM


def test_run_refuses_one_file_for_both_outputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    args = ["run", str(job(tmp_path)), "-o", str(out), "--errors", str(out),
            "--model", MODEL, "--device", "cpu"]  # fmt: skip
    assert main(args) == 1
    assert "are the same file" in capsys.readouterr().err and not out.exists()


@pytest.fixture
def planner(redis_server: RedisServer, tmp_path: Path) -> Iterator[tuple[PlannerClient, str]]:
    ingest = IngestSettings(max_model_len=MAX_MODEL_LEN)
    with planner_in_process(redis_server.url, ingest) as (server, client):
        yield client, f"127.0.0.1:{server.port}"


@pytest.mark.parametrize("name", [*PLANTED, "out.jsonl.offset"])
def test_results_refuses_a_link_at_an_output_path(
    planner: tuple[PlannerClient, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
) -> None:
    client, address = planner
    submitted = client.submit_file(job(tmp_path))
    victim = plant(tmp_path, name)
    args = ["results", submitted.id, "-o", str(tmp_path / "out.jsonl"), "--planner", address]
    assert main(args) == 1
    assert refused_in_one_line(capsys.readouterr().err, tmp_path / name)
    assert victim.read_text() == VICTIM


@pytest.mark.parametrize("name", [*PLANTED, "out.jsonl.offset"])
def test_submit_wait_refuses_a_link_at_an_output_path_and_submits_nothing(
    planner: tuple[PlannerClient, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
) -> None:
    client, address = planner
    victim = plant(tmp_path, name)
    args = ["submit", str(job(tmp_path)), "--wait", "-o", str(tmp_path / "out.jsonl"),
            "--planner", address]  # fmt: skip
    assert main(args) == 1
    assert refused_in_one_line(capsys.readouterr().err, tmp_path / name)
    assert victim.read_text() == VICTIM and client.list() == []


def test_a_link_planted_after_the_check_is_refused_when_opened(tmp_path: Path) -> None:
    victim = plant(tmp_path, "out.jsonl")
    with pytest.raises(OutputPathRefused, match="is a symbolic link"):
        open_output(tmp_path / "out.jsonl")
    assert victim.read_text() == VICTIM


def test_an_output_shorter_than_what_is_kept_is_refused_not_padded(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"one line\n")
    with pytest.raises(ValueError, match="holds 9 bytes, fewer than the 20 to keep"):
        open_output(out, keep=20)
    assert out.read_bytes() == b"one line\n"
