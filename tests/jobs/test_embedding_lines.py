"""`/v1/embeddings` lines in a batch file, as OpenAI's Batch API serves them: each answer validates as the
`openai` package's CreateEmbeddingResponse, one embedding per input in input order, `dimensions`,
`encoding_format` base64 and vLLM's `normalize`; the worker's path writes the local run's bytes."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest
from openai.types import CreateEmbeddingResponse
from services_testbed import MAX_MODEL_LEN, MODEL, batch_line

from prefixgrove.engine_settings import EngineSettings
from prefixgrove.jobs.ingest import JobIngestor
from prefixgrove.jobs.output_lines import run_tag, success_line
from prefixgrove.jobs.redis_store.schema import RequestRecord
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.jobs.requests import BatchRequest, parse_line
from prefixgrove.jobs.tokenize import PromptTokenizer
from prefixgrove.local import run_local
from prefixgrove.settings import IngestSettings
from prefixgrove.worker.engine_requests import sampling_params, token_ids
from prefixgrove.worker.runner import make_engine

URL = "/v1/embeddings"
JOB = "job_embeddings"
ENGINE = EngineSettings(device="cpu", dtype="float32")
LINES = [
    batch_line("one", {"input": "The quick brown fox", "model": MODEL}, URL),
    batch_line("many", {"input": ["first text", "second, longer text", "third"]}, URL),
    batch_line("cut", {"input": "The quick brown fox", "dimensions": 16}, URL),
    batch_line("b64", {"input": [[70, 71, 72]], "encoding_format": "base64"}, URL),
    batch_line("raw", {"input": "The quick brown fox", "normalize": False}, URL),
]


def parse(body: dict[str, Any]) -> BatchRequest | RequestError:
    line = json.dumps({"custom_id": "e", "url": URL, "body": body})
    return parse_line(line, 0, max_line_bytes=1 << 16, default_max_tokens=16)


@pytest.mark.parametrize(
    ("body", "code", "named"),
    [({"input": "x", "dimensions": 0}, "invalid_value", "dimensions"),
     ({"input": "x", "encoding_format": "hex"}, "invalid_value", "encoding_format"),
     ({"input": "x", "normalize": 1}, "invalid_value", "normalize"),
     ({"input": "x", "temperature": 0}, "unknown_field", "temperature"),
     ({"input": []}, "invalid_prompt", "input"), ({"input": ["a"] * 2049}, "invalid_prompt", "2048")],
)  # fmt: skip
def test_a_bad_embeddings_body_fails_its_line_naming_the_field(
    body: dict, code: str, named: str
) -> None:
    error = parse(body)
    assert isinstance(error, RequestError) and error.code == code and named in error.message


@pytest.fixture(scope="module")
def answered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("embeddings")
    job, out = root / "in.jsonl", root / "out.jsonl"
    job.write_text("".join(line + "\n" for line in LINES))
    ingest = IngestSettings(max_model_len=MAX_MODEL_LEN)
    summary = run_local(job, out, root / "err.jsonl", MODEL, ingest, ENGINE, use_tqdm=False,
                        run_id=JOB)  # fmt: skip
    assert summary.completed == len(LINES), summary
    return {
        json.loads(line)["custom_id"]: json.loads(line) for line in out.read_text().splitlines()
    }


def vector(body: dict[str, Any], i: int = 0) -> np.ndarray:
    return np.asarray(body["data"][i]["embedding"], dtype=np.float32)


def test_each_answer_is_an_openai_embedding_response(answered: dict[str, Any]) -> None:
    bodies = {cid: line["response"]["body"] for cid, line in answered.items()}
    for cid, body in bodies.items():
        if cid != "b64":  # the SDK's type holds floats; base64 is its wire form, checked below
            CreateEmbeddingResponse.model_validate(body, strict=True)
    assert bodies["one"]["model"] == MODEL and bodies["one"]["usage"]["prompt_tokens"] > 0
    assert [d["index"] for d in bodies["many"]["data"]] == [0, 1, 2]
    assert len({tuple(d["embedding"]) for d in bodies["many"]["data"]}) == 3
    full, cut, raw = vector(bodies["one"]), vector(bodies["cut"]), vector(bodies["raw"])
    assert np.isclose(np.linalg.norm(full), 1.0) and not np.isclose(np.linalg.norm(raw), 1.0)
    np.testing.assert_allclose(full, raw / np.linalg.norm(raw), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cut, raw[:16] / np.linalg.norm(raw[:16]), rtol=1e-5, atol=1e-6)
    decoded = np.frombuffer(base64.b64decode(bodies["b64"]["data"][0]["embedding"]), "<f4")
    assert decoded.shape == full.shape and np.isclose(np.linalg.norm(decoded), 1.0)


def test_a_worker_writes_the_local_runs_embedding_lines(answered: dict[str, Any]) -> None:
    tokenizer = PromptTokenizer(MODEL, max_model_len=MAX_MODEL_LEN)
    ingestor = JobIngestor({MODEL: tokenizer}, IngestSettings(max_model_len=MAX_MODEL_LEN))
    batch = ingestor.add([line.encode() for line in LINES])
    engine = make_engine(MODEL, ENGINE)
    records = {}
    for request, tokens in batch.requests:
        blob = RequestRecord(request.custom_id, request.endpoint, request.params, tokens,
                             request.model).encode()  # fmt: skip
        records[str(request.index)] = record = RequestRecord.decode(blob)
        engine.add_request(str(request.index), token_ids(record), sampling_params(record))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step())
    for rid, record in records.items():
        line = success_line(int(rid), record.custom_id, record.endpoint, record.params, MODEL,
                            outputs[rid], engine.tokenizer, requested_model=record.model,
                            tag=run_tag(JOB))  # fmt: skip
        assert json.loads(line) == answered[record.custom_id]
