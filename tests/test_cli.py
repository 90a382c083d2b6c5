"""The `prefixgrove` command as a user meets it: a version, one-line errors, help that names every
setting's default and variable, and logs as JSON lines when asked."""

from __future__ import annotations

import json
import logging

import pytest

from prefixgrove import __version__
from prefixgrove.cli import _configure_logging, main


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"prefixgrove {__version__}"


@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_missing_input_file_is_one_line_and_exit_2(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [command, "/no/such/input.jsonl", "-o", "out.jsonl"]
    assert main([*args, "--model", "tiny-random-llama"] if command == "run" else args) == 2
    assert capsys.readouterr().err == "error: /no/such/input.jsonl: no such file\n"


def test_help_names_each_settings_default_and_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "worker", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: 30.0; environment: PREFIXGROVE_LEASE_TIMEOUT_S" in text
    assert "environment: PREFIXGROVE_MAX_NUM_SEQS" in text


def test_json_logs_are_one_object_a_line(capsys: pytest.CaptureFixture[str]) -> None:
    _configure_logging("json")
    try:
        logging.getLogger("prefixgrove.test").warning("queue %s is empty", "q1")
        line = capsys.readouterr().err.strip().splitlines()[-1]
        entry = json.loads(line)
        assert (entry["level"], entry["message"]) == ("WARNING", "queue q1 is empty")
    finally:
        _configure_logging("text")


def test_a_job_of_a_batchjob_shows_its_namespace_and_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from prefixgrove.cli import _show
    from prefixgrove_proto import planner_pb2 as pb

    job = pb.Job(id="job_1", model="m", metadata={"namespace": "evals", "name": "nightly"})
    _show(job, as_json=False)
    assert "batchjob evals/nightly" in capsys.readouterr().out
