"""Each kind of bad input gets a clear per-request (or per-job) error, and the valid requests go on."""

from __future__ import annotations

import json

import pytest
from services_testbed import MODEL, batch_line

from prefixgrove.jobs.ingest import JobIngestor
from prefixgrove.jobs.output_lines import request_hash, run_tag
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.jobs.requests import BatchRequest, parse_line
from prefixgrove.jobs.tokenize import PromptTokenizer
from prefixgrove.settings import IngestSettings


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer(MODEL, max_model_len=256)


def ingest(tokenizer: PromptTokenizer, lines: list[str | bytes], **settings: int) -> tuple[JobIngestor, dict[int, RequestError], list[BatchRequest]]:  # fmt: skip
    ingestor = JobIngestor({MODEL: tokenizer}, IngestSettings(**settings))
    batch = ingestor.add([line.encode() if isinstance(line, str) else line for line in lines])
    return ingestor, {e.index: e for e in batch.errors}, [r for r, _ in batch.requests]


def parse(obj: object) -> BatchRequest | RequestError:
    return parse_line(json.dumps(obj), 0, max_line_bytes=1 << 16, default_max_tokens=16)


def good(i: int) -> str:
    return batch_line(f"ok-{i}", {"prompt": f"hello {i}", "max_tokens": 4})


def test_malformed_json_line_fails_alone(tokenizer: PromptTokenizer) -> None:
    _, errors, valid = ingest(tokenizer, [good(0), '{"custom_id": "x", ', good(2)])
    assert errors[1].code == "invalid_json" and "not valid JSON" in errors[1].message
    assert [r.custom_id for r in valid] == ["ok-0", "ok-2"]


def test_missing_custom_id_is_named() -> None:
    error = parse({"url": "/v1/completions", "body": {"prompt": "x"}})
    assert isinstance(error, RequestError) and error.code == "missing_custom_id"
    assert json.loads(error.to_line(run_tag("job"))) == {
        "id": f"batch_req_{run_tag('job')}{request_hash(error.index, None)}",
        "custom_id": None,
        "response": None,
        "error": {"code": "missing_custom_id", "message": error.message},
    }


def test_duplicate_custom_id_fails_the_later_line(tokenizer: PromptTokenizer) -> None:
    dup = batch_line("ok-0", {"prompt": "again"})
    _, errors, valid = ingest(tokenizer, [good(0), dup, good(1)])
    assert errors[1].code == "duplicate_custom_id" and "'ok-0'" in errors[1].message
    assert [r.custom_id for r in valid] == ["ok-0", "ok-1"]


def test_unknown_url_lists_the_accepted_ones() -> None:
    error = parse({"custom_id": "a", "url": "/v1/moderations", "body": {"input": "x"}})
    assert isinstance(error, RequestError) and error.code == "invalid_url"
    assert "/v1/moderations" in error.message and "/v1/embeddings" in error.message


@pytest.mark.parametrize(
    "obj, field",
    [
        (
            {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}, "extra": 1},
            "extra",
        ),
        (
            {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "guided": 2}},
            "guided",
        ),
        ({"custom_id": "a", "url": "/v1/chat/completions", "body": {"prompt": "x"}}, "prompt"),
    ],
)
def test_unknown_field_is_named(obj: dict, field: str) -> None:
    error = parse(obj)
    assert (
        isinstance(error, RequestError) and error.code == "unknown_field" and field in error.message
    )


def test_prompt_over_max_model_len_fails(tokenizer: PromptTokenizer) -> None:
    long = batch_line("long", {"prompt": "x" * 300, "max_tokens": 4})
    edge = batch_line("edge", {"prompt": [65] * 250, "max_tokens": 6})  # 250 + 6 == 256 fits
    _, errors, valid = ingest(tokenizer, [long, edge])
    assert errors[0].code == "context_length_exceeded" and "256" in errors[0].message
    assert [r.custom_id for r in valid] == ["edge"]


def test_token_ids_outside_the_vocabulary_fail(tokenizer: PromptTokenizer) -> None:
    bad = batch_line("bad", {"prompt": [1, 2, tokenizer.vocab_size]})
    negative = batch_line("neg", {"prompt": [5, -1]})
    _, errors, valid = ingest(tokenizer, [bad, negative, good(0)])
    assert errors[0].code == "invalid_token_id" and str(tokenizer.vocab_size) in errors[0].message
    assert errors[1].code == "invalid_token_id"
    assert len(valid) == 1


def test_empty_file_is_a_job_error(tokenizer: PromptTokenizer) -> None:
    ingestor, errors, _ = ingest(tokenizer, ["", "   "])
    assert errors == {} and ingestor.job_error() == (
        "empty_file",
        "the input holds no request lines",
    )


def test_non_jsonl_file_is_a_job_error(tokenizer: PromptTokenizer) -> None:
    ingestor, errors, _ = ingest(tokenizer, ["id,prompt", "1,hello", "2,world"])
    code, message = ingestor.job_error()  # type: ignore[misc]
    assert code == "invalid_file" and "not JSONL" in message
    assert len(errors) == 3


def test_line_over_the_size_limit_fails(tokenizer: PromptTokenizer) -> None:
    big = batch_line("big", {"prompt": "y" * 5000})
    _, errors, _ = ingest(tokenizer, [big, good(1)], max_line_bytes=1000)
    assert errors[0].code == "line_too_large" and "1000" in errors[0].message


@pytest.mark.parametrize(
    "body, name",
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": ""}, "prompt"),
    ],
)
def test_bad_values_name_the_field(body: dict, name: str) -> None:
    error = parse({"custom_id": "a", "url": "/v1/completions", "body": body})
    assert isinstance(error, RequestError) and name in error.message


def test_chat_and_sampling_fields_are_carried() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0.5,
            "top_k": -1, "seed": 7, "stop": "\n", "logprobs": True, "top_logprobs": 2}  # fmt: skip
    request = parse(
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}
    )
    assert isinstance(request, BatchRequest) and request.endpoint == "chat"
    assert request.params == {
        "max_tokens": 3,
        "temperature": 0.5,
        "top_k": 0,
        "seed": 7,
        "stop": ["\n"],
        "logprobs": 2,
    }


def test_chat_prompts_use_the_chat_template(tokenizer: PromptTokenizer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    chat = batch_line("c", body, "/v1/chat/completions")
    [(_, tokens)] = JobIngestor({MODEL: tokenizer}, IngestSettings()).add([chat.encode()]).requests
    text = tokenizer.tokenizer.decode(tokens.tolist())
    assert (
        text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
        and "hi<|eot_id|>" in text
    )


def test_grouping_plan_covers_every_valid_request_once(tokenizer: PromptTokenizer) -> None:
    doc = "shared system prompt " * 10
    lines = [batch_line(f"r{i}", {"prompt": doc + str(i), "max_tokens": 2}) for i in range(20)]
    lines.insert(5, "not json")
    ingestor, _, _ = ingest(tokenizer, lines, ungrouped_chunk=4)
    plan = ingestor.plan()[MODEL]
    covered = sorted(i for unit in plan.units for i in unit.indices)
    assert covered == [i for i in range(21) if i != 5]
    assert plan.num_groups >= 1 and plan.prefix_tokens_saved > 0


def completion(body: dict, custom_id: str = "a") -> str:
    return json.dumps({"custom_id": custom_id, "url": "/v1/completions", "body": body})


@pytest.mark.parametrize(
    ("body", "field", "shown"),
    [
        ({"prompt": "x", "top_k": 10**30}, "top_k", "1" + "0" * 30),
        ({"prompt": "x", "max_tokens": 2**31}, "max_tokens", str(2**31)),
        ({"prompt": "x", "stop_token_ids": [2**63]}, "stop_token_ids", str(2**63)),
        ({"prompt": "x", "seed": 2**64}, "seed", str(2**64)),
        ({"prompt": "x", "temperature": 10**400}, "temperature", "an integer of 1329 bits"),
        ({"prompt": [1, 10**30]}, "prompt token", "1" + "0" * 30),
        ({"prompt": [1, 2**63]}, "prompt token", str(2**63)),
    ],
    ids=[
        "top_k",
        "max_tokens",
        "stop_token_ids",
        "seed",
        "temperature",
        "token-1e30",
        "token-2**63",
    ],
)
def test_numbers_beyond_what_the_engine_holds_name_field_and_value(
    body: dict, field: str, shown: str
) -> None:
    error = parse_line(completion(body), 0, max_line_bytes=1 << 16, default_max_tokens=16)
    assert isinstance(error, RequestError) and error.custom_id == "a"
    assert field in error.message and shown in error.message


def test_a_lone_surrogate_in_custom_id_fails_with_no_custom_id_and_a_writable_line() -> None:
    line = '{"custom_id": "x\\ud800", "url": "/v1/completions", "body": {"prompt": "hi"}}'
    error = parse_line(line, 0, max_line_bytes=1 << 16, default_max_tokens=16)
    assert isinstance(error, RequestError) and error.custom_id is None
    assert (
        error.code == "invalid_value"
        and "custom_id" in error.message
        and "\\ud800" in error.message
    )
    error.to_line(run_tag("job")).encode("utf-8")


@pytest.mark.parametrize(
    ("body", "url", "path"),
    [
        ('{"prompt": "hi \\udc00"}', "/v1/completions", "body.prompt"),
        ('{"messages": [{"role": "user", "content": "\\ud83d"}]}', "/v1/chat/completions", "body.messages[0].content"),
        ('{"prompt": "hi", "stop": ["\\udfff"]}', "/v1/completions", "body.stop[0]"),
    ],
    ids=["prompt", "message", "stop"],
)  # fmt: skip
def test_a_lone_surrogate_in_a_field_names_the_field(body: str, url: str, path: str) -> None:
    line = f'{{"custom_id": "a", "url": "{url}", "body": {body}}}'
    error = parse_line(line, 0, max_line_bytes=1 << 16, default_max_tokens=16)
    assert isinstance(error, RequestError) and error.custom_id == "a"
    assert error.code == "invalid_value" and error.message.startswith(f"{path} holds a lone")


def test_a_surrogate_pair_is_one_character_and_accepted() -> None:
    line = completion({"prompt": "smile \ud83d\ude00"})  # written as the escapes \\ud83d\\ude00
    request = parse_line(line, 0, max_line_bytes=1 << 16, default_max_tokens=16)
    assert isinstance(request, BatchRequest) and request.prompt_text == "smile \U0001f600"


DEEP_STOP = completion({"prompt": "x", "stop": "S"}).replace('"S"', "[" * 40 + "]" * 40)


@pytest.mark.parametrize("line", ["[" * 100_000, DEEP_STOP], ids=["unparseable", "parsed"])
def test_deep_nesting_fails_its_line(line: str) -> None:
    error = parse_line(line, 0, max_line_bytes=1 << 20, default_max_tokens=16)
    assert isinstance(error, RequestError) and error.code == "nesting_too_deep"
    assert "at most 32" in error.message


def test_a_line_that_is_not_utf8_fails_alone(tokenizer: PromptTokenizer) -> None:
    text = '{"custom_id": "l", "url": "/v1/completions", "body": {"prompt": "caf\u00e9"}}'
    latin1 = text.encode("latin-1")  # the é is the byte 0xe9
    _, errors, valid = ingest(tokenizer, [good(0), latin1, good(2)])
    assert errors[1].code == "invalid_encoding" and "byte 0xe9" in errors[1].message
    assert [r.custom_id for r in valid] == ["ok-0", "ok-2"]


@pytest.mark.parametrize(
    ("encoding", "named"),
    [("utf-16", "UTF-16 (little-endian, with a byte order mark)"), ("utf-16-be", "UTF-16 (big-endian)"), ("utf-32-le", "UTF-32 (little-endian)")],
)  # fmt: skip
def test_an_input_in_utf16_or_utf32_is_one_job_error_naming_it(
    tokenizer: PromptTokenizer, encoding: str, named: str
) -> None:
    data = "\n".join([good(0), good(1), good(2)]).encode(encoding)
    ingestor, errors, valid = ingest(tokenizer, data.split(b"\n"))
    assert errors == {} and valid == [] and ingestor.total == 3
    code, message = ingestor.job_error()  # type: ignore[misc]
    assert code == "invalid_encoding" and named in message and "UTF-8" in message


def test_a_utf8_byte_order_mark_is_skipped(tokenizer: PromptTokenizer) -> None:
    _, errors, valid = ingest(tokenizer, [b"\xef\xbb\xbf" + good(0).encode(), good(1)])
    assert errors == {} and [r.custom_id for r in valid] == ["ok-0", "ok-1"]


@pytest.mark.parametrize(
    ("body", "code", "named"),
    [
        ({"prompt": "x"}, "invalid_url", "['/v1/completions']"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]}, "invalid_messages", "content[0]"),
    ],
    ids=["url-list", "text-part-object"],
)  # fmt: skip
def test_values_of_the_wrong_type_fail_their_line(body: dict, code: str, named: str) -> None:
    url: object = ["/v1/completions"] if code == "invalid_url" else "/v1/chat/completions"
    error = parse({"custom_id": "a", "url": url, "body": body})
    assert isinstance(error, RequestError) and error.code == code and named in error.message


def test_a_prompt_the_tokenizer_refuses_fails_alone(
    tokenizer: PromptTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    encode_batch = tokenizer._encode_batch

    def refuse_boom(texts: list[str], special: bool) -> list[list[int]]:
        if any("BOOM" in t for t in texts):
            raise RuntimeError("cannot tokenize BOOM")
        return encode_batch(texts, special)

    monkeypatch.setattr(tokenizer, "_encode_batch", refuse_boom)
    boom = batch_line("boom", {"prompt": "BOOM", "max_tokens": 4})
    _, errors, valid = ingest(tokenizer, [good(0), boom, good(2)])
    assert errors[1].code == "invalid_prompt" and "cannot tokenize BOOM" in errors[1].message
    assert [r.custom_id for r in valid] == ["ok-0", "ok-2"]
