"""Structured outputs in a batch file run by `prefixgrove run`: OpenAI's response_format and vLLM's
structured_outputs / guided_* fields reach the engine, every constrained answer holds to its constraint
(even on random weights: the mask decides), and a constraint that does not compile is that request's
error line while the rest of the job runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from services_testbed import MAX_MODEL_LEN, MODEL, batch_line, service_env

CHOICES = ["alpha", "beta", "gamma"]
ENUM_SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": CHOICES}, "ok": {"type": "boolean"}},
    "required": ["kind", "ok"],
    "additionalProperties": False,
}


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
    ]  # fmt: skip
    done = run(tmp_path, lines)
    assert done.returncode == 0, done.stderr[-2000:]
    outputs = {
        o["custom_id"]: o["response"]["body"]["choices"][0]
        for o in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())
    }
    assert set(outputs) == {"schema", "schema-seeded", "choice", "regex", "free"}
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
    assert set(errors) == {"bad-regex", "bad-schema"}
    assert "regex does not compile" in errors["bad-regex"]["message"]
    assert "/nope" in errors["bad-schema"]["message"]
