"""The `prefixgrove` command as a user meets it: a version, one-line errors, help that names every
setting's default and variable, and logs as JSON lines when asked."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from services_testbed import MAX_MODEL_LEN, MODEL, batch_line, free_port

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
    assert capsys.readouterr().err == "prefixgrove: error: /no/such/input.jsonl: no such file\n"


def test_a_bad_setting_in_the_environment_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PREFIXGROVE_PORT", "fifty")
    assert main(["serve", "planner"]) == 2
    err = capsys.readouterr().err
    assert err == "prefixgrove: error: PREFIXGROVE_PORT='fifty' is invalid: expected int\n"


def test_a_bad_log_format_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PREFIXGROVE_LOG_FORMAT", "xml")
    assert main(["list"]) == 2
    assert capsys.readouterr().err == (
        "prefixgrove: error: log_format='xml' is invalid: expected text or json\n"
    )


def test_an_unreachable_planner_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "job_1", "--planner", f"127.0.0.1:{free_port()}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("prefixgrove: error: planner GetJob: UNAVAILABLE")
    assert err.count("\n") == 1 and "Traceback" not in err


def write_job(path: Path, n: int = 6) -> Path:
    shared = "You answer questions about the garden in one short sentence, kindly. " * 4
    lines = [
        batch_line(f"q{i}", {"prompt": f"{shared}Question {i}?", "max_tokens": 3 + i, "temperature": 0})
        for i in range(n)
    ]  # fmt: skip
    path.write_text("".join(line + "\n" for line in [*lines, "{not json"]))
    return path


def run_args(tmp_path: Path, *extra: str) -> list[str]:
    job = write_job(tmp_path / "in.jsonl")
    return ["run", str(job), "-o", str(tmp_path / "out.jsonl"), "--model", MODEL, "--device",
            "cpu", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), *extra]  # fmt: skip


def test_run_logs_each_phase_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(run_args(tmp_path)) == 0
    captured = capsys.readouterr()
    assert "6 completed, 1 failed of 7" in captured.out
    progress = [line.split("prefixgrove.run: ", 1)[1] for line in captured.err.splitlines()
                if " INFO prefixgrove.run: " in line]  # fmt: skip
    said = "\n".join(progress)
    assert "loading model tiny-random-llama" in said
    assert "model tiny-random-llama loaded in " in said
    assert "read 7 lines in " in said and ": 6 requests, " in said and ", 1 invalid lines" in said
    assert "grouped in " in said and ": 1 groups, " in said and "shared-prefix tokens" in said
    assert "decoded 6/6 requests in " in said
    phases = ["loading the tokenizer", "reading and tokenizing", "grouping", "loading model",
              "decoding"]  # fmt: skip
    starts = [next(i for i, line in enumerate(progress) if line.startswith(p)) for p in phases]
    assert starts == sorted(starts)
    assert "Generating" not in captured.err  # not a terminal: no bar, the log says it


def test_run_with_json_logs_writes_only_json_lines_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # after the command too: a global option applies wherever it is given
    assert main([*run_args(tmp_path), "--log-format", "json"]) == 0
    lines = capsys.readouterr().err.splitlines()
    entries = [json.loads(line) for line in lines]
    messages = [e["message"] for e in entries if e["logger"] == "prefixgrove.run"]
    assert any(m.startswith("decoded 6/6 requests") for m in messages), messages


def test_quiet_run_says_nothing_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--quiet", *run_args(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "6 completed" in captured.out


def test_decode_progress_comes_between_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from prefixgrove.engine_settings import EngineSettings
    from prefixgrove.local import run_local
    from prefixgrove.settings import IngestSettings

    job = write_job(tmp_path / "in.jsonl")
    engine = EngineSettings(device="cpu", dtype="float32", seed=0, max_num_seqs=2)
    out = tmp_path / "out.jsonl"
    with caplog.at_level(logging.INFO, logger="prefixgrove.run"):
        run_local(job, out, tmp_path / "err.jsonl", MODEL, IngestSettings(max_model_len=MAX_MODEL_LEN),
                  engine, use_tqdm=False, progress_every_s=0)  # fmt: skip
    decoded = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decoded ")]
    done = [int(m.split()[1].split("/")[0]) for m in decoded]
    # two at a time: several steps finish some, each reported as it happens, then the end
    assert len(done) >= 3 and done == sorted(done) and done[-1] == 6, decoded
    assert all(m.split()[1].endswith("/6") for m in decoded)
    read = [r.getMessage() for r in caplog.records if r.getMessage().startswith("read ")]
    assert read[-1].startswith("read 7 lines in ")


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
    from prefixgrove.cli_client import _show
    from prefixgrove_proto import planner_pb2 as pb

    job = pb.Job(id="job_1", model="m", metadata={"namespace": "evals", "name": "nightly"})
    _show(job, as_json=False)
    assert "batchjob evals/nightly" in capsys.readouterr().out
