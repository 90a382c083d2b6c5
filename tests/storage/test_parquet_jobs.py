"""Parquet datasets through `prefixgrove run`: rows in, the same rows out with the generated text,
finish reason, token counts and error added, from a file or a bucket, a row group at a time."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from object_store_testbed import S3Server
from services_testbed import MAX_MODEL_LEN, MODEL

from prefixgrove.cli import main


def dataset(path: Path) -> Path:
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(6)]
    prompts[2] = None  # type: ignore[call-overload]  # a row with no prompt fails alone
    table = pa.table({"id": [f"q{i}" for i in range(6)], "text": prompts, "topic": ["math"] * 6})
    pq.write_table(table, path, row_group_size=4)  # two row groups
    return path


def run(source: str, output: str, *extra: str) -> int:
    return main(["run", source, "-o", output, "--model", MODEL, "--device", "cpu", "--dtype",
                 "float32", "--max-model-len", str(MAX_MODEL_LEN), "--prompt-column", "text",
                 "--id-column", "id", "--sampling-json", json.dumps({"max_tokens": 3}),
                 "--quiet", "--json", *extra])  # fmt: skip


def test_a_parquet_round_trip_adds_the_result_columns_row_for_row(tmp_path: Path) -> None:
    out = tmp_path / "out.parquet"
    assert run(str(dataset(tmp_path / "in.parquet")), str(out)) == 0
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == [f"q{i}" for i in range(6)]
    assert all(r["topic"] == "math" for r in rows)
    done = [r for i, r in enumerate(rows) if i != 2]
    assert all(r["completion_tokens"] == 3 and r["finish_reason"] == "length" for r in done)
    assert all(isinstance(r["generated_text"], str) and r["error"] is None for r in done)
    assert rows[2]["generated_text"] is None and rows[2]["error"].startswith("invalid_prompt")


def test_a_parquet_dataset_from_a_bucket_into_a_bucket(
    s3: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bucket = s3.bucket()
    s3.put(bucket, "data/in.parquet", dataset(tmp_path / "in.parquet").read_bytes())
    assert run(f"s3://{bucket}/data/in.parquet", f"s3://{bucket}/data/out.parquet") == 0
    (tmp_path / "got.parquet").write_bytes(s3.get(bucket, "data/out.parquet"))
    rows = pq.read_table(tmp_path / "got.parquet").to_pylist()
    assert len(rows) == 6 and rows[0]["completion_tokens"] == 3
    assert "data/out.parquet" in s3.keys(bucket)


def test_a_parquet_input_names_a_missing_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = dataset(tmp_path / "in.parquet")
    status = main(["run", str(source), "-o", str(tmp_path / "o.parquet"), "--model", MODEL,
                   "--prompt-column", "prompt"])  # fmt: skip
    assert status == 2 and "no column 'prompt'" in capsys.readouterr().err
