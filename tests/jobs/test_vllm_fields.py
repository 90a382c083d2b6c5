"""vLLM's request fields beyond OpenAI's, in a batch body as vLLM's OpenAI server takes them: sampling
fields reach the engine, echo and the chat template's options are kept for where they act, and a bad
value fails its line naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest
from services_testbed import MODEL

from prefixgrove.jobs.ingest import JobIngestor
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.jobs.requests import BatchRequest, parse_line
from prefixgrove.jobs.sampling_fields import sampling_kwargs
from prefixgrove.jobs.tokenize import PromptTokenizer
from prefixgrove.jobs.vllm_fields import ChatOptions
from prefixgrove.settings import IngestSettings

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def parse(extra: dict[str, Any], url: str = CHAT) -> BatchRequest | RequestError:
    body = {"messages": MESSAGES} if url == CHAT else {"prompt": "hi"}
    line = json.dumps({"custom_id": "a", "url": url, "body": body | extra})
    return parse_line(line, 0, max_line_bytes=1 << 16, default_max_tokens=16)


def accepted(extra: dict[str, Any], url: str = CHAT) -> BatchRequest:
    request = parse(extra, url)
    assert isinstance(request, BatchRequest), request
    return request


SAMPLING = {
    "min_tokens": 2, "bad_words": ["foo bar"], "allowed_token_ids": [5, 6],
    "include_stop_str_in_output": True, "skip_special_tokens": False, "prompt_logprobs": 3,
    "truncate_prompt_tokens": 12, "repetition_penalty": 1.1, "top_k": 5, "min_p": 0.1,
}  # fmt: skip


@pytest.mark.parametrize("url", [CHAT, COMPLETIONS])
def test_vllms_sampling_fields_reach_the_engine(url: str) -> None:
    from prefixgrove.engine import SamplingParams

    request = accepted({**SAMPLING, "spaces_between_special_tokens": False}, url)
    assert request.params == {"max_tokens": 16, **SAMPLING}
    params = SamplingParams(**sampling_kwargs(request.params))
    assert (params.min_tokens, params.allowed_token_ids, params.prompt_logprobs) == (2, [5, 6], 3)


@pytest.mark.parametrize(
    ("field", "value"),
    [("min_tokens", 17), ("min_tokens", -1), ("bad_words", ["  "]), ("bad_words", "x"),
     ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("include_stop_str_in_output", 1),
     ("skip_special_tokens", "no"), ("spaces_between_special_tokens", None or 0),
     ("prompt_logprobs", 21), ("truncate_prompt_tokens", 0), ("echo", "yes"),
     ("chat_template_kwargs", ["enable_thinking"]), ("add_generation_prompt", "no")],
)  # fmt: skip
def test_a_bad_value_fails_its_line_naming_the_field(field: str, value: Any) -> None:
    error = parse({field: value})
    assert isinstance(error, RequestError), error
    assert error.code == "invalid_value" and field in error.message


def test_echo_is_kept_for_the_output_line_and_never_reaches_sampling() -> None:
    completion = accepted({"echo": True}, COMPLETIONS)
    assert completion.params["echo"] is True
    assert "echo" not in sampling_kwargs(completion.params)
    follows = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    chat = accepted({"messages": follows, "echo": True, "continue_final_message": True,
                     "add_generation_prompt": False})  # fmt: skip
    assert chat.params["echo_prefix"] == "The answer is"
    assert "echo_prefix" not in sampling_kwargs(chat.params)
    assert "echo_prefix" not in accepted({"echo": True}).params  # the last message is the user's


def test_echo_of_prompt_logprobs_is_refused_by_name() -> None:
    error = parse({"echo": True, "logprobs": 2}, COMPLETIONS)
    assert isinstance(error, RequestError) and error.code == "unsupported_field"
    assert "echo with logprobs is not supported" in error.message


@pytest.mark.parametrize(
    ("extra", "named"),
    [({"continue_final_message": True}, "cannot both be true"),
     ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs may not set tokenize")],
)  # fmt: skip
def test_chat_template_options_that_cannot_work_are_refused(extra: dict, named: str) -> None:
    error = parse(extra)
    assert isinstance(error, RequestError) and error.code == "invalid_value"
    assert named in error.message


def test_the_chat_templates_options_reach_the_template(monkeypatch: pytest.MonkeyPatch) -> None:
    """A template that reads a keyword (Qwen3's enable_thinking) gets it; add_generation_prompt
    false and continue_final_message leave the last message open."""
    tokenizer = PromptTokenizer(MODEL, max_model_len=256)
    # the tokenizer is the process's cached one: its own template comes back after the test
    monkeypatch.setattr(
        tokenizer.tokenizer,
        "chat_template",
        (
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
            "{% if not (continue_final_message and loop.last) %}</{{ m['role'] }}>{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}<assistant>"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
            "{% endif %}"
        ),
    )
    follows = [*MESSAGES, {"role": "assistant", "content": "So"}]
    bodies = {
        "default": {"messages": MESSAGES},
        "no-thinking": {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}},
        "continue": {"messages": follows, "add_generation_prompt": False,
                     "continue_final_message": True},
    }  # fmt: skip
    lines = [json.dumps({"custom_id": k, "url": CHAT, "body": {**b, "max_tokens": 4}}).encode()
             for k, b in bodies.items()]  # fmt: skip
    batch = JobIngestor({MODEL: tokenizer}, IngestSettings()).add(lines)
    texts = {r.custom_id: tokenizer.tokenizer.decode(ids.tolist()) for r, ids in batch.requests}
    assert texts["default"].endswith("<user>hi</user><assistant>")
    assert texts["no-thinking"].endswith("<user>hi</user><assistant><think></think>")
    assert texts["continue"].endswith("<user>hi</user><assistant>So")
    assert ChatOptions().as_kwargs() == {
        "add_generation_prompt": True, "continue_final_message": False}  # fmt: skip


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens_before_the_length_check() -> None:
    tokenizer = PromptTokenizer(MODEL, max_model_len=64)
    body = {"prompt": list(range(1, 101)), "max_tokens": 8, "truncate_prompt_tokens": 20}
    kept = json.dumps({"custom_id": "t", "url": COMPLETIONS, "body": body}).encode()
    too_long = json.dumps({"custom_id": "u", "url": COMPLETIONS,
                           "body": {**body, "truncate_prompt_tokens": 60}}).encode()  # fmt: skip
    batch = JobIngestor({MODEL: tokenizer}, IngestSettings()).add([kept, too_long])
    [(_, ids)] = batch.requests
    assert ids.tolist() == list(range(81, 101))
    [error] = batch.errors
    assert error.code == "context_length_exceeded" and "60 tokens" in error.message
