"""A completions `prompt` given as a list of strings or of token lists, as OpenAI defines it: one line,
one answer whose choices are each prompt's n samples in turn; the worker's path (a request record
through its engine) writes the local run's bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types import Completion
from services_testbed import MAX_MODEL_LEN, MODEL, batch_line

from prefixgrove.engine_settings import EngineSettings
from prefixgrove.jobs.ingest import JobIngestor
from prefixgrove.jobs.output_lines import run_tag, success_line
from prefixgrove.jobs.prompt_parts import PARTS, PromptParts
from prefixgrove.jobs.redis_store.schema import RequestRecord
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.jobs.requests import BatchRequest, parse_line
from prefixgrove.jobs.tokenize import PromptTokenizer
from prefixgrove.local import run_local
from prefixgrove.settings import IngestSettings
from prefixgrove.worker.engine_requests import sampling_params, token_ids
from prefixgrove.worker.runner import make_engine

ENGINE = EngineSettings(device="cpu", dtype="float32")
JOB = "job_prompt_lists"
TEXTS = ["The first prompt", "A second, longer prompt than the first"]
LINES = [
    batch_line("texts", {"prompt": TEXTS, "max_tokens": 3, "n": 2, "seed": 4, "echo": True}),
    batch_line("ids", {"prompt": [[70, 71, 72], [80, 81]], "max_tokens": 2, "temperature": 0}),
    batch_line("one", {"prompt": ["a single prompt in a list"], "max_tokens": 2}),
]


def parse(prompt: Any, **fields: Any) -> BatchRequest | RequestError:
    line = json.dumps({"custom_id": "a", "url": "/v1/completions",
                       "body": {"prompt": prompt, "max_tokens": 4, **fields}})  # fmt: skip
    return parse_line(line, 0, max_line_bytes=1 << 16, default_max_tokens=16)


def test_a_list_of_prompts_is_one_request_of_several_prompts() -> None:
    texts, ids = parse(TEXTS), parse([[1, 2], [3]])
    assert isinstance(texts, BatchRequest) and texts.prompt_parts == TEXTS
    assert isinstance(ids, BatchRequest) and [p.tolist() for p in ids.prompt_parts or []] == [
        [1, 2], [3]]  # fmt: skip
    single = parse(["just one"])
    assert isinstance(single, BatchRequest) and single.prompt_text == "just one"


@pytest.mark.parametrize(
    ("prompt", "fields", "code"),
    [(["a", [1]], {}, "invalid_prompt"), (["a", ""], {}, "invalid_prompt"),
     (["a"] * 129, {}, "invalid_prompt"), (["a", "b"], {"prompt_logprobs": 1}, "unsupported_field")],
)  # fmt: skip
def test_a_list_of_prompts_that_cannot_run_is_named(prompt: Any, fields: dict, code: str) -> None:
    error = parse(prompt, **fields)
    assert isinstance(error, RequestError) and error.code == code


def test_each_prompt_is_tokenized_and_checked_on_its_own() -> None:
    tokenizer = PromptTokenizer(MODEL, max_model_len=40)
    fits = json.dumps({"custom_id": "f", "url": "/v1/completions",
                       "body": {"prompt": [[9, 9], [5, 6, 7]], "max_tokens": 4}}).encode()  # fmt: skip
    too_long = json.dumps({"custom_id": "t", "url": "/v1/completions",
                           "body": {"prompt": ["ab", "x" * 50], "max_tokens": 4}}).encode()  # fmt: skip
    batch = JobIngestor({MODEL: tokenizer}, IngestSettings()).add([fits, too_long])
    [(request, tokens)] = batch.requests
    assert request.params[PARTS] == [2, 3] and tokens.tolist() == [9, 9, 5, 6, 7]
    [error] = batch.errors
    assert error.code == "context_length_exceeded" and error.message.startswith("prompt 1: ")


@pytest.fixture(scope="module")
def answered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lists")
    job = root / "in.jsonl"
    job.write_text("".join(line + "\n" for line in LINES))
    ingest = IngestSettings(max_model_len=MAX_MODEL_LEN)
    out = root / "out.jsonl"
    summary = run_local(job, out, root / "err.jsonl", MODEL, ingest, ENGINE, use_tqdm=False,
                        run_id=JOB)  # fmt: skip
    assert summary.completed == 3, summary
    return {json.loads(line)["custom_id"]: line for line in out.read_text().splitlines()}


def test_the_answer_holds_each_prompts_samples_in_turn(answered: dict[str, Any]) -> None:
    body = json.loads(answered["texts"])["response"]["body"]
    Completion.model_validate(body, strict=True)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"].startswith(TEXTS[c["index"] // 2]) for c in body["choices"]] == [True] * 4
    completions = sum(len(c["token_ids"]) for c in body["choices"])
    assert body["usage"]["completion_tokens"] == completions
    ids = json.loads(answered["ids"])["response"]["body"]
    assert ids["usage"]["prompt_tokens"] == 5 and len(ids["choices"]) == 2


def test_a_worker_writes_the_local_runs_line(answered: dict[str, Any]) -> None:
    """The worker's path: the request record as Redis holds it, its prompts split again, run
    through the worker's engine and answered under the job's run tag."""
    tokenizer = PromptTokenizer(MODEL, max_model_len=MAX_MODEL_LEN)
    ingestor = JobIngestor({MODEL: tokenizer}, IngestSettings(max_model_len=MAX_MODEL_LEN))
    batch = ingestor.add([line.encode() for line in LINES[:2]])
    records = {
        str(r.index): RequestRecord.decode(
            RequestRecord(r.custom_id, r.endpoint, r.params, tokens, r.model).encode()
        )
        for r, tokens in batch.requests
    }
    engine = make_engine(MODEL, ENGINE)
    for rid, record in records.items():
        assert isinstance(token_ids(record), PromptParts)
        engine.add_request(rid, token_ids(record), sampling_params(record))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step())
    assert sorted(outputs) == ["0", "1"]
    for rid, record in records.items():
        line = success_line(int(rid), record.custom_id, record.endpoint, record.params, MODEL,
                            outputs[rid], engine.tokenizer, requested_model=record.model,
                            tag=run_tag(JOB))  # fmt: skip
        assert line == answered[record.custom_id]


def test_the_job_never_groups_a_line_of_several_prompts(tmp_path: Path) -> None:
    shared = "Shared instructions that every line starts with, long enough to group. " * 2
    lines = [batch_line(f"q{i}", {"prompt": f"{shared}question {i}", "max_tokens": 2})
             for i in range(3)]  # fmt: skip
    lines.append(batch_line("list", {"prompt": [f"{shared}x", f"{shared}y"], "max_tokens": 2}))
    tokenizer = PromptTokenizer(MODEL, max_model_len=MAX_MODEL_LEN)
    ingestor = JobIngestor({MODEL: tokenizer}, IngestSettings())
    ingestor.add([line.encode() for line in lines])
    plan = ingestor.plan()[MODEL]
    grouped = [u.indices for u in plan.units if u.prefix_len]
    assert grouped == [[0, 1, 2]]


def test_the_engine_runs_a_groups_line_of_several_prompts_alone_and_aborts_it_whole() -> None:
    from prefixgrove.engine import SamplingParams
    from prefixgrove.grouping import PrefixGroup

    engine = make_engine(MODEL, ENGINE)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    shared = list(range(40, 80))
    members = [("plain-a", [*shared, 1], greedy), ("parts", PromptParts(([5, 6], [7])), greedy),
               ("plain-b", [*shared, 2], greedy)]  # fmt: skip
    engine.add_group("g", PrefixGroup(32, (0, 1, 2)), members)
    engine.add_request("dropped", PromptParts(([8, 9], [10, 11])), greedy)
    engine.abort(["dropped"])
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step())
    assert sorted(outputs) == ["parts", "plain-a", "plain-b"]
    assert outputs["plain-a"].num_shared_prefix_tokens == 32  # the others still share the prefix
    assert [c.index for c in outputs["parts"].outputs] == [0, 1]
    assert outputs["parts"].prompt_token_ids == [5, 6, 7]
