"""Structured outputs in a batch file run by `prefixgrove run`: OpenAI's response_format and vLLM's
structured_outputs / guided_* fields reach the engine, every constrained answer holds to its constraint
(even on random weights: the mask decides), and a constraint that does not compile, that no output can
meet (unsatisfiable_constraint) or whose matcher fails mid-decode (constraint_failed) is that request's
error line while the rest of the job runs, the same bytes from the planner and a worker as from `run`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from run_tags import as_job
from services_testbed import (
    MAX_MODEL_LEN,
    MODEL,
    batch_line,
    local_run,
    service_env,
    service_stack,
    wait_until,
)

from prefixgrove_proto import planner_pb2 as pb

CHOICES = ["alpha", "beta", "gamma"]
ENUM_SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": CHOICES}, "ok": {"type": "boolean"}},
    "required": ["kind", "ok"],
    "additionalProperties": False,
}
# Properties in reverse alphabetical order, an object nested among them: the answer keeps this order.
ORDERED_SCHEMA = {
    "type": "object",
    "properties": {
        "verdict": {"enum": CHOICES},
        "inner": {"type": "object", "properties": {"z": {"type": "boolean"}, "a": {"enum": [1, 2]}},
                  "required": ["z", "a"], "additionalProperties": False},
        "answer": {"type": "boolean"},
    },
    "required": ["verdict", "inner", "answer"],
    "additionalProperties": False,
}  # fmt: skip
# No whitespace token (the byte tokenizer's ids of space, tab, newline, carriage return): free JSON
# whitespace could run on random weights to max_tokens.
NO_WHITESPACE = {"32": -100, "9": -100, "10": -100, "13": -100}
# Fine until a choice, then a rule of 3,000 alternatives: llguidance's parser row holds 3,001 items
# there (its limit is 2,000), and the matcher fails mid-decode.
WIDE_RULE = (
    'start: "{\\"verdict\\": \\"" ("valid" | "invalid") "\\", \\"score\\": " score\n'
    "score: " + " | ".join(f'"s{i}"' for i in range(3000))
)
# Constraints no output can meet, one of each kind.
UNSATISFIABLE = {
    "enum-none": {"structured_outputs": {"json": {"enum": []}}},
    "schema-none": {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                    "schema": {"type": "object", "properties": {"a": {"enum": []}},
                               "required": ["a"]}}}},
    "regex-none": {"guided_regex": "x[a&&b]"},
    "grammar-none": {"guided_grammar": 'root ::= "a" root'},
    "choice-none": {"structured_outputs": {"choice": []}},
}  # fmt: skip


def run(tmp_path: Path, lines: list[str]) -> subprocess.CompletedProcess[str]:
    job = tmp_path / "in.jsonl"
    job.write_text("".join(line + "\n" for line in lines))
    args = [sys.executable, "-m", "prefixgrove.cli", "run", str(job), "-o", str(tmp_path / "out.jsonl"),
            "--model", MODEL, "--device", "cpu", "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--quiet"]  # fmt: skip
    return subprocess.run(args, env=service_env(), capture_output=True, text=True, timeout=300)


def chat(custom_id: str, **fields: object) -> str:
    body = {"messages": [{"role": "user", "content": f"Pick one ({custom_id})"}], "max_tokens": 40}
    return batch_line(custom_id, {**body, **fields}, "/v1/chat/completions")


def test_constrained_lines_hold_to_their_constraint_and_a_bad_one_fails_alone(tmp_path: Path):
    # Compact JSON: on random weights, whitespace could go on to max_tokens.
    compact = {"json": ENUM_SCHEMA, "disable_any_whitespace": True}
    lines = [
        chat("schema", structured_outputs=compact, temperature=0),
        chat("schema-seeded", structured_outputs=compact, temperature=1.0, seed=7),
        chat("choice", structured_outputs={"choice": CHOICES}, temperature=1.0, seed=1),
        chat("regex", guided_regex="[0-9]{3}-[a-z]{2}", temperature=0),
        chat("bad-regex", guided_regex="([", temperature=0),
        chat("bad-schema", response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}),
        chat("free", temperature=0, max_tokens=5),
        chat("ordered", temperature=0, max_tokens=80, logit_bias=NO_WHITESPACE, response_format={
            "type": "json_schema", "json_schema": {"name": "o", "strict": True,
                                                   "schema": ORDERED_SCHEMA}}),
        chat("strict-open", response_format={"type": "json_schema", "json_schema": {
            "name": "o", "strict": True, "schema": {**ORDERED_SCHEMA,
                                                    "additionalProperties": True}}}),
    ]  # fmt: skip
    done = run(tmp_path, lines)
    assert done.returncode == 0, done.stderr[-2000:]
    outputs = {
        o["custom_id"]: o["response"]["body"]["choices"][0]
        for o in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())
    }
    assert set(outputs) == {"schema", "schema-seeded", "choice", "regex", "free", "ordered"}
    ordered = json.loads(outputs["ordered"]["message"]["content"], object_pairs_hook=list)
    assert [k for k, _ in ordered] == ["verdict", "inner", "answer"]
    assert [k for k, _ in ordered[1][1]] == ["z", "a"]
    for name in ("schema", "schema-seeded"):
        answer = json.loads(outputs[name]["message"]["content"])
        assert answer["kind"] in CHOICES and isinstance(answer["ok"], bool)
    assert outputs["choice"]["message"]["content"] in CHOICES
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", outputs["regex"]["message"]["content"])
    assert all(outputs[n]["finish_reason"] == "stop" for n in ("schema", "choice", "regex"))
    errors = {
        e["custom_id"]: e["error"]
        for e in map(json.loads, (tmp_path / "out.errors.jsonl").read_text().splitlines())
    }
    assert set(errors) == {"bad-regex", "bad-schema", "strict-open"}
    assert errors["strict-open"]["code"] == "invalid_value"
    assert "must set additionalProperties to false" in errors["strict-open"]["message"]
    assert "regex does not compile" in errors["bad-regex"]["message"]
    assert "/nope" in errors["bad-schema"]["message"]


@pytest.fixture(scope="module")
def failing_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """Answered lines, lines refused up front and lines whose matcher fails mid-decode, and the
    output and error files of their local run (both tests below read it)."""
    lines = [
        chat("wide", guided_grammar=WIDE_RULE, temperature=0, max_tokens=64),
        chat("choice", structured_outputs={"choice": CHOICES}, temperature=1.0, seed=1),
        chat("wide-seeded", guided_grammar=WIDE_RULE, temperature=1.0, seed=3, max_tokens=64),
        *(chat(name, **fields) for name, fields in UNSATISFIABLE.items()),
        chat("free", temperature=0, max_tokens=5),
    ]
    d = tmp_path_factory.mktemp("failing")
    path = d / "in.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path, *local_run(path, d / "local")


def test_a_constraint_that_fails_mid_decode_or_accepts_nothing_is_an_error_line(
    failing_job: tuple[Path, Path, Path],
):
    _, out, errors = failing_job
    answered = {o["custom_id"]: o for o in map(json.loads, out.read_text().splitlines())}
    assert set(answered) == {"choice", "free"}
    assert answered["choice"]["response"]["body"]["choices"][0]["message"]["content"] in CHOICES
    failed = {e["custom_id"]: e["error"] for e in map(json.loads, errors.read_text().splitlines())}
    assert set(failed) == {"wide", "wide-seeded", *UNSATISFIABLE}
    for name in ("wide", "wide-seeded"):
        assert failed[name]["code"] == "constraint_failed"
        assert failed[name]["message"].startswith(
            "structured_outputs.grammar could not be enforced"
        )
        assert "Current row has 3001 items" in failed[name]["message"]
    for name in UNSATISFIABLE:
        assert failed[name]["code"] == "unsatisfiable_constraint", failed[name]
    assert "accepts no output" in failed["grammar-none"]["message"]


def test_the_services_write_the_same_error_lines_as_the_local_run(
    failing_job: tuple[Path, Path, Path], tmp_path: Path
):
    """A worker ends the failing requests as `prefixgrove run` does: the same output and error
    files, byte for byte."""
    job, local_out, local_errors = failing_job
    (tmp_path / "stack").mkdir()
    with service_stack(tmp_path / "stack", workers={"w1": ()}) as stack:
        client = stack.client()
        submitted = client.submit_file(job)
        wait_until(lambda: client.get(submitted.id).state == pb.JOB_STATE_COMPLETED, 180,
                   f"job {submitted.id} to complete")  # fmt: skip
        out, errors = tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
        client.download(submitted.id, out, errors)
    assert out.read_text() == as_job(local_out, submitted.id)
    assert errors.read_text() == as_job(local_errors, submitted.id)
    assert len(errors.read_text().splitlines()) == 2 + len(UNSATISFIABLE)
