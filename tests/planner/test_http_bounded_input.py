"""A batch whose input holds a 1 GiB line, through the OpenAI Batch API of a planner process (with
a worker and a redis-server): the planner's peak memory stays within a ceiling while the file
uploads and streams into its job, the line fails alone as line_too_large, the others are answered."""

from __future__ import annotations

import json
from pathlib import Path

from http_uploads import MultipartUpload
from openai import OpenAI
from openai.types import Batch
from services_testbed import batch_line, free_port, service_stack, wait_for_port
from test_http_api import wait_for_end
from test_input_lines import CEILING, huge_line_input


def test_a_batch_with_a_1gib_line_keeps_the_planner_within_the_ceiling(tmp_path: Path) -> None:
    http_port = free_port()
    args = ("--http-port", str(http_port), "--data-dir", str(tmp_path / "data"),
            "--parse-processes", "1")  # fmt: skip
    with service_stack(tmp_path, workers={"w1": ()}, planner_args=args) as stack:
        wait_for_port(http_port, stack.planner)
        client = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="-", max_retries=0)
        small = tmp_path / "small.jsonl"
        small.write_text(batch_line("warm", {"prompt": "Say it", "max_tokens": 2}) + "\n")
        run_batch(client, http_port, small)  # the tokenizer loads: a cost of any first batch
        status = Path(f"/proc/{stack.planner.proc.pid}/status")
        status.with_name("clear_refs").write_text("5")  # peak := current
        before = _bytes(status, "VmHWM")
        done = run_batch(client, http_port, huge_line_input(tmp_path / "in.jsonl"))
        grown = _bytes(status, "VmHWM") - before
        assert grown < CEILING, f"the planner's peak grew by {grown} bytes"
        assert done.status == "completed" and done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.failed) == (3, 1)
        assert done.output_file_id and done.error_file_id
        outputs = client.files.content(done.output_file_id).content.splitlines()
        assert [json.loads(line)["custom_id"] for line in outputs] == ["before", "after"]
        [error] = client.files.content(done.error_file_id).content.splitlines()
        assert json.loads(error)["error"]["code"] == "line_too_large"


def run_batch(client: OpenAI, http_port: int, job: Path) -> Batch:
    """Uploads `job` (streamed from disk), runs it as a batch and waits for its end."""
    uploaded = MultipartUpload(job).send(http_port)
    assert uploaded.status == 200, uploaded.body
    batch = client.batches.create(input_file_id=uploaded.body["id"], completion_window="24h",
                                  endpoint="/v1/completions")  # fmt: skip
    return wait_for_end(client, batch.id)


def _bytes(status: Path, field: str) -> int:
    for row in status.read_text().splitlines():
        if row.startswith(field + ":"):
            return int(row.split()[1]) * 1024
    raise AssertionError(f"{status} has no {field}")
