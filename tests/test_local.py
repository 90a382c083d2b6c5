"""`prefixgrove run`: one process, no Redis; output in input order, failures in the error file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from services_testbed import MAX_MODEL_LEN, MODEL, batch_line, service_env

from prefixgrove.cli import main as cli
from prefixgrove.grouping import PrefixGroup
from prefixgrove.jobs.ingest import JobPlan
from prefixgrove.jobs.redis_store.schema import GroupRecord
from prefixgrove.local import _engine_groups


def run(tmp_path: Path, lines: list[str], *extra: str) -> subprocess.CompletedProcess[str]:
    job = tmp_path / "in.jsonl"
    job.write_text("".join(line + "\n" for line in lines))
    args = [sys.executable, "-m", "prefixgrove.cli", "run", str(job), "-o", str(tmp_path / "out.jsonl"),
            "--model", MODEL, "--device", "cpu", "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), *extra]  # fmt: skip
    return subprocess.run(args, env=service_env(), capture_output=True, text=True, timeout=300)


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


@pytest.mark.parametrize(
    ("content", "code"),
    [("\n", "empty_file"), ("custom_id,prompt\n1,hello\n", "invalid_file")],
    ids=["empty", "not-jsonl"],
)
def test_local_run_refuses_an_input_that_is_not_a_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, code: str
) -> None:
    job = tmp_path / "in.txt"
    job.write_text(content)
    exit_code = cli(
        ["run", str(job), "-o", str(tmp_path / "o.jsonl"), "--model", MODEL, "--device", "cpu"]
    )
    assert exit_code == 2 and code in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_the_plan_reaches_the_engine_as_groups_over_the_accepted_requests() -> None:
    """Line 3 failed the engine's checks: its group keeps one request and runs it alone; the
    ungrouped chunk (prefix 0) is no group."""
    plan = JobPlan(
        [GroupRecord(32, [0, 2, 5]), GroupRecord(48, [1, 3]), GroupRecord(0, [4])], 80, 2
    )
    assert _engine_groups(plan, [0, 1, 2, 4, 5]) == [PrefixGroup(32, (0, 2, 4))]


def run_in_process(tmp_path: Path, data: bytes, *extra: str) -> tuple[int, list[dict], list[dict]]:
    job = tmp_path / "in.jsonl"
    job.write_bytes(data)
    out = tmp_path / "out.jsonl"
    args = ["run", str(job), "-o", str(out), "--model", MODEL, "--device", "cpu", "--json",
            "--max-model-len", str(MAX_MODEL_LEN), *extra]  # fmt: skip
    code = cli(args)
    if code != 0:
        return code, [], []
    errors_path = tmp_path / "out.errors.jsonl"
    read = [
        [json.loads(line) for line in p.read_text("utf-8").splitlines()] for p in (out, errors_path)
    ]
    return code, read[0], read[1]


def test_values_that_would_break_the_engine_fail_only_their_own_lines(tmp_path: Path) -> None:
    ok = [batch_line(f"ok{i}", {"prompt": f"hello {i}", "max_tokens": 2}) for i in range(3)]
    bad = [
        batch_line("top_k", {"prompt": "x", "top_k": 10**30, "max_tokens": 2}),
        batch_line("ids", {"prompt": [1, 10**30], "max_tokens": 2}),
        batch_line("ids63", {"prompt": [1, 2**63], "max_tokens": 2}),
        '{"custom_id": "\\ud800", "url": "/v1/completions", "body": {"prompt": "x"}}',
        '{"custom_id": "p", "url": "/v1/completions", "body": {"prompt": "x\\ud800"}}',
        "[" * 5000,  # deeper than the JSON parser can recurse
        batch_line("big", {"prompt": "y" * 9000, "max_tokens": 2}),
    ]
    lines = [ok[0], *bad[:4], ok[1], *bad[4:], ok[2]]
    data = "".join(line + "\n" for line in lines).encode()
    code, outputs, errors = run_in_process(tmp_path, data, "--max-line-bytes", "8000")
    assert code == 0
    assert [o["custom_id"] for o in outputs] == ["ok0", "ok1", "ok2"]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("top_k", "invalid_value"),
        ("ids", "invalid_token_id"),
        ("ids63", "invalid_token_id"),
        (None, "invalid_value"),
        ("p", "invalid_value"),
        (None, "nesting_too_deep"),
        (None, "line_too_large"),
    ]


def test_an_input_in_utf16_is_one_file_error_naming_the_encoding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [batch_line(f"c{i}", {"prompt": "hi", "max_tokens": 2}) for i in range(3)]
    code, _, _ = run_in_process(tmp_path, "\n".join(lines).encode("utf-16"))
    err = capsys.readouterr().err
    assert code == 2 and "invalid_encoding" in err and "UTF-16 (little-endian" in err
    said = [line for line in err.splitlines() if " INFO prefixgrove.run: " not in line]  # progress
    assert len(said) == 1 and said[0].startswith("prefixgrove: error: invalid_encoding: ")
    assert not (tmp_path / "out.jsonl").exists()


def test_a_line_naming_a_model_the_run_does_not_serve_is_model_not_found_and_the_rest_runs(
    tmp_path: Path,
) -> None:
    body = {"prompt": "Say something", "max_tokens": 2, "temperature": 0}
    lines = [batch_line("by-name", {**body, "model": "graded"}),
             batch_line("by-source", {**body, "model": MODEL}),
             batch_line("unnamed", body)]  # fmt: skip
    done = run(tmp_path, lines, "--served-model-name", "graded")
    assert done.returncode == 0, done.stderr[-2000:]
    outputs = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(o["custom_id"], o["response"]["body"]["model"]) for o in outputs] == [
        ("by-name", "graded"),
        ("unnamed", "graded"),
    ]
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("by-source", "model_not_found")
    ]


def test_several_served_model_names_run_lines_naming_any_of_them(tmp_path: Path) -> None:
    """vLLM's `--served-model-name NAME ALIAS...`: a file written for another provider runs by
    adding its model as an alias; each answer names the model its line asked for."""
    body = {"prompt": "Say something", "max_tokens": 2, "temperature": 0}
    lines = [batch_line("openai", {**body, "model": "gpt-4o-mini"}),
             batch_line("own", {**body, "model": "graded"}),
             batch_line("unnamed", body),
             batch_line("other", {**body, "model": "gpt-4o"})]  # fmt: skip
    done = run(tmp_path, lines, "--served-model-name", "graded", "gpt-4o-mini")
    assert done.returncode == 0, done.stderr[-2000:]
    outputs = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(o["custom_id"], o["response"]["body"]["model"]) for o in outputs] == [
        ("openai", "gpt-4o-mini"), ("own", "graded"), ("unnamed", "graded")]  # fmt: skip
    texts = {o["response"]["body"]["choices"][0]["text"] for o in outputs}
    assert len(texts) == 1  # one model answered the same prompt alike under every name
    [error] = [
        json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()
    ]
    assert (error["custom_id"], error["error"]["code"]) == ("other", "model_not_found")


def test_run_exits_non_zero_when_every_line_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "in.jsonl"
    job.write_text("{not json\n" + batch_line("big", {"prompt": "x", "max_tokens": 10**6}) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["run", str(job), "-o", str(out), "--model", MODEL, "--device", "cpu",
            "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--quiet"]  # fmt: skip
    assert cli(args) == 1
    assert f"every line failed (2): see {tmp_path / 'out.errors.jsonl'}" in capsys.readouterr().err
    assert len((tmp_path / "out.errors.jsonl").read_text().splitlines()) == 2
    job.write_text(job.read_text() + batch_line("ok", {"prompt": "x", "max_tokens": 1}) + "\n")
    assert cli(args) == 0


def test_lines_asking_alike_share_one_sampling_params() -> None:
    """A job holds every request until it ends: alike requests hold one SamplingParams, not one
    each (2.4 KB a line), and a schema's key order keeps two schemas apart."""
    from prefixgrove.engine import LLM
    from prefixgrove.jobs.requests import BatchRequest, parse_line
    from prefixgrove.local import _runnable

    def request(i: int, body: dict) -> tuple[BatchRequest, list[int]]:
        line = batch_line(f"r{i}", {"prompt": [1, 2, 3], "max_tokens": 2, **body})
        parsed = parse_line(line, i, max_line_bytes=1 << 16, default_max_tokens=16)
        assert isinstance(parsed, BatchRequest)
        return parsed, [1, 2, 3]

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    swapped = {**schema, "properties": dict(reversed(schema["properties"].items()))}
    bodies = [{}] * 50 + [{"temperature": 0}] + [{"guided_json": s} for s in (schema, swapped)]
    llm = LLM(MODEL, device="cpu", dtype="float32", num_gpu_blocks_override=16)
    runnable = _runnable(llm, [request(i, b) for i, b in enumerate(bodies)], [])
    assert len({id(params) for _, _, params in runnable}) == 4
    assert len({id(params) for _, _, params in runnable[:50]}) == 1
