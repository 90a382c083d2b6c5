"""`prefixgrove run`: one process, no Redis; output in input order, failures in the error file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from services_testbed import MAX_MODEL_LEN, MODEL, batch_line, service_env

from prefixgrove.cli import main as cli


def run(tmp_path: Path, lines: list[str], *extra: str) -> subprocess.CompletedProcess[str]:
    job = tmp_path / "in.jsonl"
    job.write_text("".join(line + "\n" for line in lines))
    args = [sys.executable, "-m", "prefixgrove.cli", "run", str(job), "-o", str(tmp_path / "out.jsonl"),
            "--model", MODEL, "--device", "cpu", "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), *extra]  # fmt: skip
    return subprocess.run(args, env=service_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_local_run_answers_every_request_in_input_order(tmp_path: Path) -> None:
    shared = "You grade answers. Be brief and exact. " * 4
    lines = [batch_line(f"c{i}", {"prompt": f"{shared}Answer {i}", "max_tokens": 3, "temperature": 0}) for i in range(12)]  # fmt: skip
    lines.insert(4, "{not json")
    lines.insert(8, batch_line("c1", {"prompt": "duplicate", "max_tokens": 3}))
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 2,
    }
    lines.append(batch_line("chat", chat, "/v1/chat/completions"))
    done = run(tmp_path, lines, "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["total"], summary["completed"], summary["failed"]) == (15, 13, 2)
    assert summary["prefix_tokens_saved"] > 0
    outputs = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == [f"c{i}" for i in range(12)] + ["chat"]
    first = outputs[0]["response"]
    assert first["status_code"] == 200 and outputs[0]["error"] is None
    choice = first["body"]["choices"][0]
    assert len(choice["token_ids"]) == 3 and choice["finish_reason"] == "length"
    assert first["body"]["usage"]["completion_tokens"] == 3
    last = outputs[-1]["response"]["body"]
    assert (
        last["object"] == "chat.completion" and last["choices"][0]["message"]["role"] == "assistant"
    )
    assert len(last["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        (None, "invalid_json"),
        ("c1", "duplicate_custom_id"),
    ]


def test_local_run_refuses_an_empty_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "empty.jsonl"
    job.write_text("\n")
    code = cli(
        ["run", str(job), "-o", str(tmp_path / "o.jsonl"), "--model", MODEL, "--device", "cpu"]
    )
    assert code == 2 and "empty_file" in capsys.readouterr().err


def test_local_run_refuses_a_file_that_is_not_jsonl(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "data.csv"
    job.write_text("custom_id,prompt\n1,hello\n")
    code = cli(
        ["run", str(job), "-o", str(tmp_path / "o.jsonl"), "--model", MODEL, "--device", "cpu"]
    )
    assert code == 2 and "invalid_file" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()
