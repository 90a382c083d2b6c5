"""Output and error lines are what OpenAI's Batch API writes: every body of a real run (the local
run on the tiny model: chat and completions, with and without logprobs, grouped and alone)
validates strictly as the `openai` package's ChatCompletion / Completion, and error lines carry
OpenAI's id, custom_id, response and error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from services_testbed import MAX_MODEL_LEN, MODEL, batch_line, service_env

from prefixgrove.jobs.output_lines import error_line, request_hash, run_tag, served_model_name

CHAT = "/v1/chat/completions"
RUN_ID = "job_test"
TAG = run_tag(RUN_ID)
SHARED = "You grade answers. Be brief and exact and never repeat the question. " * 3
SYSTEM = {"role": "system", "content": SHARED}
ALLOWED = list(range(97, 123))  # the byte tokenizer's ids of a-z
REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    *[(f"grouped-{i}", {"prompt": f"{SHARED}Answer {i}", "max_tokens": 3, "temperature": 0}, "/v1/completions") for i in range(3)],
    ("grouped-logprobs", {"prompt": f"{SHARED}Answer 9", "max_tokens": 3, "logprobs": 2}, "/v1/completions"),
    ("alone-logprobs", {"prompt": "Lonely words", "max_tokens": 4, "logprobs": 3}, "/v1/completions"),
    ("alone", {"prompt": "Another line", "max_tokens": 2, "n": 1, "seed": 3, "user": "u1"}, "/v1/completions"),
    ("chat-grouped-0", {"messages": [SYSTEM, {"role": "user", "content": "a"}], "max_tokens": 3}, CHAT),
    ("chat-grouped-1", {"messages": [SYSTEM, {"role": "user", "content": "b"}], "max_tokens": 3,
                        "logprobs": True, "top_logprobs": 2}, CHAT),
    ("chat-alone", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2,
                    "logprobs": True, "n": 1, "model": MODEL, "user": "u1",
                    "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                    "parallel_tool_calls": True, "response_format": {"type": "text"},
                    "logit_bias": {"5": 1.5}, "stop": ["\n\n"], "seed": 11}, CHAT),
    ("grouped-samples", {"prompt": f"{SHARED}Answer 7", "max_tokens": 3, "n": 2, "best_of": 2,
                         "temperature": 1.0, "seed": 5, "logprobs": 1}, "/v1/completions"),
    ("chat-samples", {"messages": [{"role": "user", "content": "pick"}], "max_tokens": 3, "n": 3,
                      "temperature": 1.0, "seed": 6, "logprobs": True}, CHAT),
    ("chat-json", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 6,
                   "response_format": {"type": "json_object"}}, CHAT),
    ("vllm-completion", {"prompt": "A vLLM request echoing its prompt", "max_tokens": 8,
                         "min_tokens": 6, "echo": True, "prompt_logprobs": 1,
                         "truncate_prompt_tokens": 12, "allowed_token_ids": ALLOWED,
                         "temperature": 0}, "/v1/completions"),
    ("chat-vllm", {"messages": [{"role": "user", "content": "go on"},
                                {"role": "assistant", "content": "Well"}],
                   "echo": True, "add_generation_prompt": False, "continue_final_message": True,
                   "chat_template_kwargs": {"enable_thinking": False}, "prompt_logprobs": 2,
                   "bad_words": ["the"], "include_stop_str_in_output": True,
                   "skip_special_tokens": False, "spaces_between_special_tokens": True,
                   "max_tokens": 3}, CHAT),
    ("tools", {"messages": [{"role": "user", "content": "x"}], "tools": []}, CHAT),
    ("best-of", {"prompt": "x", "n": 2, "best_of": 3}, "/v1/completions"),
]  # fmt: skip


@pytest.fixture(scope="module")
def answered(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """The local run's output and error lines of REQUESTS, by custom_id."""
    root = tmp_path_factory.mktemp("openai")
    job = root / "in.jsonl"
    job.write_text("".join(batch_line(cid, body, url) + "\n" for cid, body, url in REQUESTS))
    args = [sys.executable, "-m", "prefixgrove.cli", "run", str(job), "-o", str(root / "out.jsonl"),
            "--model", MODEL, "--device", "cpu", "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--run-id", RUN_ID]  # fmt: skip
    done = subprocess.run(args, env=service_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return _by_id(root / "out.jsonl"), _by_id(root / "out.errors.jsonl")


def _by_id(path: Path) -> dict[str, Any]:
    lines = [json.loads(line) for line in path.read_text("utf-8").splitlines()]
    return {line["custom_id"]: line for line in lines}


def _body(answered: tuple[dict[str, Any], dict[str, Any]], custom_id: str) -> dict[str, Any]:
    return answered[0][custom_id]["response"]["body"]


def test_every_success_line_is_an_openai_batch_line(answered: tuple[dict, dict]) -> None:
    outputs, _ = answered
    assert sorted(outputs) == sorted(cid for cid, _, _ in REQUESTS[:-2])
    # a JSON object, or the start of one max_tokens cut short
    assert _body(answered, "chat-json")["choices"][0]["message"]["content"].startswith("{")
    for custom_id, line in outputs.items():
        h = TAG + request_hash(
            REQUESTS.index(next(r for r in REQUESTS if r[0] == custom_id)), custom_id
        )
        assert line["id"].startswith(f"batch_req_{h}") and line["error"] is None
        assert len(line["id"]) == len(f"batch_req_{h}") + 16  # and the request's fingerprint
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"] == h


def test_every_body_validates_strictly_as_the_openai_type(answered: tuple[dict, dict]) -> None:
    for custom_id, line in answered[0].items():
        body = line["response"]["body"]
        model = ChatCompletion if custom_id.startswith("chat") else Completion
        parsed = model.model_validate(body, strict=True)
        assert parsed.usage is not None and parsed.usage.prompt_tokens_details is not None
        assert {c.finish_reason for c in parsed.choices} <= {"stop", "length"}


def test_cached_tokens_count_the_prompt_reused_from_a_shared_prefix(
    answered: tuple[dict, dict],
) -> None:
    def cached(custom_id: str) -> tuple[int, int]:
        usage = _body(answered, custom_id)["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

    grouped = [cached(f"grouped-{i}") for i in range(3)] + [cached("grouped-logprobs")]
    assert len({reused for reused, _ in grouped}) == 1  # the one prefix they share
    assert all(0 < reused < prompt for reused, prompt in grouped)
    assert cached("alone")[0] == 0 and cached("alone-logprobs")[0] == 0


def test_chat_logprobs_hold_token_logprob_bytes_and_top_logprobs(
    answered: tuple[dict, dict],
) -> None:
    content = _body(answered, "chat-grouped-1")["choices"][0]["logprobs"]["content"]
    assert len(content) == _body(answered, "chat-grouped-1")["usage"]["completion_tokens"]
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        assert len(entry["top_logprobs"]) == 2
        assert all(top["bytes"] == list(top["token"].encode()) for top in entry["top_logprobs"])
    assert _body(answered, "chat-grouped-0")["choices"][0]["logprobs"] is None


def test_completion_logprobs_hold_tokens_logprobs_tops_and_offsets(
    answered: tuple[dict, dict],
) -> None:
    choice = _body(answered, "alone-logprobs")["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(choice["token_ids"]) == len(logprobs["token_logprobs"])
    assert all(len(top) == 3 for top in logprobs["top_logprobs"])
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"][-1] == len(choice["text"]) - len(logprobs["tokens"][-1])


def test_model_is_the_served_model_name_whether_the_body_names_it_or_not(
    answered: tuple[dict, dict],
) -> None:
    assert _body(answered, "chat-alone")["model"] == MODEL  # named in its body
    others = {_body(answered, cid)["model"] for cid in answered[0] if cid != "chat-alone"}
    assert others == {MODEL}


def test_unserved_or_malformed_features_fail_their_request_naming_the_field(
    answered: tuple[dict, dict],
) -> None:
    errors = answered[1]
    assert sorted(errors) == ["best-of", "tools"]
    assert errors["best-of"]["error"]["code"] == "unsupported_field"
    assert "best_of 3" in errors["best-of"]["error"]["message"]
    assert errors["tools"]["error"] == {
        "code": "invalid_value", "message": "tools must not be empty: leave it out instead"}  # fmt: skip


def test_vllms_fields_shape_the_answer(answered: tuple[dict, dict]) -> None:
    """echo puts the (truncated) prompt before the completion and the assistant's open message
    before the reply; prompt_logprobs score every prompt token but the first; allowed_token_ids
    and min_tokens hold the completion."""
    completion = _body(answered, "vllm-completion")
    [choice] = completion["choices"]
    assert completion["usage"]["prompt_tokens"] == 12
    prompt = next(b["prompt"] for c, b, _ in REQUESTS if c == "vllm-completion")
    assert choice["text"].startswith(prompt[-12:])  # the last 12 tokens, a byte each
    assert len(choice["token_ids"]) >= 6 and set(choice["token_ids"]) <= set(ALLOWED)
    scored = choice["prompt_logprobs"]
    assert len(scored) == 12 and scored[0] is None
    assert all(1 <= len(entry) <= 2 for entry in scored[1:])
    assert all(
        {"logprob", "rank", "decoded_token"} == set(e) for x in scored[1:] for e in x.values()
    )
    chat = _body(answered, "chat-vllm")
    assert chat["choices"][0]["message"]["content"].startswith("Well")
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_n_samples_are_n_choices_indexed_in_order(answered: tuple[dict, dict]) -> None:
    for custom_id, n in (("grouped-samples", 2), ("chat-samples", 3)):
        body = _body(answered, custom_id)
        assert [c["index"] for c in body["choices"]] == list(range(n))
        assert body["usage"]["completion_tokens"] == sum(
            len(c["token_ids"]) for c in body["choices"]
        )
        assert all(c["logprobs"] is not None for c in body["choices"])
    assert _body(answered, "grouped-samples")["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_error_lines_hold_id_custom_id_null_response_and_error(
    answered: tuple[dict, dict],
) -> None:
    for custom_id, line in answered[1].items():
        index = next(i for i, r in enumerate(REQUESTS) if r[0] == custom_id)
        assert line == {
            "id": f"batch_req_{TAG}{request_hash(index, custom_id)}",
            "custom_id": custom_id,
            "response": None,
            "error": {"code": line["error"]["code"], "message": line["error"]["message"]},
        }


def test_an_error_line_without_custom_id_still_has_an_id() -> None:
    line = json.loads(error_line(4, None, "invalid_json", "line is not valid JSON", TAG))
    assert line["id"] == f"batch_req_{TAG}{request_hash(4, None)}" and line["custom_id"] is None
    assert line["response"] is None and line["error"]["code"] == "invalid_json"


@pytest.mark.parametrize(
    "model, name",
    [("/models/SmolLM2-135M/", "SmolLM2-135M"), ("./tiny", "tiny"), ("org/name", "org/name")],
)
def test_a_local_checkout_is_named_by_its_folder_and_a_hub_id_as_given(
    model: str, name: str
) -> None:
    assert served_model_name(model) == name
