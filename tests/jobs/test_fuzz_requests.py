"""Fuzzing the request parser and the tokenizer: whatever a line holds, it yields exactly one request
or one error, nothing raises, and what passes is something the engine can hold."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from request_strategies import request_lines
from services_testbed import MODEL

from prefixgrove.engine.core.prompt_ids import checked_token_ids
from prefixgrove.engine.sampling.sampling_params import SamplingParams
from prefixgrove.jobs.ingest import JobIngestor
from prefixgrove.jobs.output_lines import request_hash, run_tag
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.jobs.requests import BatchRequest, parse_line
from prefixgrove.jobs.sampling_fields import sampling_kwargs
from prefixgrove.jobs.tokenize import PromptTokenizer
from prefixgrove.settings import IngestSettings

FUZZ = settings(
    max_examples=1000,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer(MODEL, max_model_len=MAX_MODEL_LEN)


def assert_writable(error: RequestError) -> None:
    line = json.loads(error.to_line(run_tag("job")).encode("utf-8"))
    assert line["custom_id"] == error.custom_id and line["error"]["code"] == error.code
    assert line["id"].startswith("batch_req_") and line["response"] is None
    assert error.custom_id is None or isinstance(error.custom_id, str)


def assert_engine_can_hold(request: BatchRequest) -> None:
    # the engine's own checks: a ValueError would fail the test
    SamplingParams(**sampling_kwargs(request.params))
    request_hash(request.index, request.custom_id).encode()
    texts = [request.custom_id, request.prompt_text or ""]
    texts += [m[k] for m in request.messages or [] for k in ("role", "content")]
    for text in texts:
        text.encode("utf-8")


@FUZZ
@given(line=request_lines("a"))
def test_parse_line_gives_one_request_or_one_error_and_never_raises(line: bytes) -> None:
    item = parse_line(line, 7, max_line_bytes=1 << 14, default_max_tokens=2)
    assert item.index == 7
    if isinstance(item, RequestError):
        assert_writable(item)
    else:
        assert_engine_can_hold(item)


@FUZZ
@given(line=request_lines("a"))
def test_a_line_given_as_text_is_judged_like_its_bytes(line: bytes) -> None:
    text = line.decode("utf-8", "surrogateescape")
    item = parse_line(text, 0, max_line_bytes=1 << 14, default_max_tokens=2)
    assert isinstance(item, (BatchRequest, RequestError))
    if isinstance(item, RequestError):
        assert_writable(item)


@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_each_line_of_a_batch_is_one_tokenized_request_or_one_error(
    tokenizer: PromptTokenizer, data: st.DataObject
) -> None:
    lines = [data.draw(request_lines(f"L{i}"), label=f"line {i}") for i in range(6)]
    ingestor = JobIngestor(
        {MODEL: tokenizer}, IngestSettings(max_line_bytes=1 << 14, tokenize_batch=4)
    )
    batch = ingestor.add(lines)
    assert ingestor.total == sum(1 for line in lines if line.strip())
    answered = [r.index for r, _ in batch.requests] + [e.index for e in batch.errors]
    if ingestor.encoding is not None:  # not UTF-8: the job fails whole, no line is judged
        assert answered == [] and ingestor.job_error()[0] == "invalid_encoding"  # type: ignore[index]
        return
    assert sorted(answered) == list(range(ingestor.total))
    for error in batch.errors:
        assert_writable(error)
    for request, tokens in batch.requests:
        assert_engine_can_hold(request)
        checked_token_ids(tokens.tolist(), tokenizer.vocab_size)
        assert len(tokens) + request.params["max_tokens"] <= MAX_MODEL_LEN
