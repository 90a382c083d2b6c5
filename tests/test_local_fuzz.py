"""Fuzzed files through `prefixgrove run` (run_local) on the tiny model: every request line gets
exactly one output or error line, in input order, and nothing raises."""

from __future__ import annotations

import json
from pathlib import Path
from tempfile import TemporaryDirectory

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from request_strategies import request_lines
from services_testbed import MODEL, batch_line

from prefixgrove.engine_settings import EngineSettings
from prefixgrove.local import run_local
from prefixgrove.settings import IngestSettings

LINES = 8


def answered_ids(path: Path) -> list[str | None]:
    return [json.loads(line)["custom_id"] for line in path.read_text("utf-8").splitlines()]


@settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_a_fuzzed_file_gets_one_answer_per_request_line_in_order(data: st.DataObject) -> None:
    # The first line is a valid request, so the file is a batch and every line is judged alone.
    lines = [batch_line("L0", {"prompt": "hello", "max_tokens": 2}).encode()]
    lines += [data.draw(request_lines(f"L{i}"), label=f"line {i}") for i in range(1, LINES)]
    with TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "in.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
        summary = run_local(
            root / "in.jsonl",
            root / "out.jsonl",
            root / "errors.jsonl",
            MODEL,
            IngestSettings(max_model_len=64, default_max_tokens=2, max_line_bytes=1 << 14),
            EngineSettings(device="cpu", dtype="float32"),
            use_tqdm=False,
        )
        outputs, errors = answered_ids(root / "out.jsonl"), answered_ids(root / "errors.jsonl")
    requests = [f"L{i}" for i, line in enumerate(lines) if line.strip()]
    assert summary.total == len(requests) == len(outputs) + len(errors)
    assert summary.completed == len(outputs) and summary.failed == len(errors)
    assert outputs[0] == "L0" and outputs == sorted(outputs, key=requests.index)
    named = [e for e in errors if e is not None]
    assert all(e in requests for e in named) and named == sorted(named, key=requests.index)
