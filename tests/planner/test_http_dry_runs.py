"""A dry run through the OpenAI Batch API (`dry_run` in the create body, extra_body in the SDK):
the batch ends completed with its plan beside OpenAI's fields, which the SDK still reads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai import OpenAI
from services_testbed import RedisServer, batch_line, free_port, planner_in_process, wait_until

from prefixgrove.settings import IngestSettings


@pytest.fixture
def client(redis_server: RedisServer, tmp_path: Path) -> Iterator[OpenAI]:
    port = free_port()
    with planner_in_process(redis_server.url, IngestSettings(max_model_len=512), http_port=port,
                            data_dir=str(tmp_path / "data")):  # fmt: skip
        yield OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)


def input_file(client: OpenAI, tmp_path: Path) -> str:
    shared = "Shared instructions for every request. " * 4
    body = {"max_tokens": 3, "ignore_eos": True}
    lines = [batch_line(f"r{i}", {**body, "prompt": f"{shared}item {i}"}) for i in range(5)]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with path.open("rb") as f:
        return client.files.create(file=f, purpose="batch").id


def test_a_dry_run_batch_completes_with_its_plan(client: OpenAI, tmp_path: Path) -> None:
    batch = client.batches.create(
        input_file_id=input_file(client, tmp_path), endpoint="/v1/completions",
        completion_window="24h", extra_body={"dry_run": {"gpu": "l40s", "gpus": 4}},
    )  # fmt: skip
    wait_until(lambda: client.batches.retrieve(batch.id).status == "completed", 60, "the plan")
    done = client.batches.retrieve(batch.id)
    assert done.output_file_id is None and done.request_counts.total == 5
    plan = done.model_extra["plan"]  # type: ignore[index]
    assert (plan["requests"], plan["groups"], plan["output_tokens"]) == (5, 1, 15)
    assert plan["devices"]["l40s"]["gpus"] == 4
    runs = client.batches.create(input_file_id=input_file(client, tmp_path),
                                 endpoint="/v1/completions", completion_window="24h")  # fmt: skip
    wait_until(lambda: client.batches.retrieve(runs.id).status == "in_progress", 60, "the seal")
    running = client.batches.retrieve(runs.id)
    assert running.status == "in_progress" and "plan" not in (running.model_extra or {})


@pytest.mark.parametrize("dry_run", ["yes", {"gpu": "tpu"}, {"gpus": "four"}, {"colour": "red"}])
def test_a_bad_dry_run_is_refused_with_400(client: OpenAI, tmp_path: Path, dry_run: object) -> None:
    file_id = input_file(client, tmp_path)
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                              completion_window="24h", extra_body={"dry_run": dry_run})  # fmt: skip
