"""Tool calls and reasoning in chat lines, as vLLM's OpenAI server gives them, on the chat templates
the model families publish (tests/jobs/chat_templates/: Llama 3.1, Qwen2.5 (Hermes tool calls),
Mistral v0.3, Qwen3 and DeepSeek-R1, as their tokenizer configs hold them): tools are rendered
through the template, replies are parsed in the family's format into `message.tool_calls` and
`message.reasoning_content`, and every answer validates as the `openai` package's ChatCompletion."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion
from services_testbed import MODEL

from prefixgrove.engine.sampling.outputs import CompletionOutput, RequestOutput
from prefixgrove.jobs.ingest import JobIngestor
from prefixgrove.jobs.output_lines import run_tag, success_line
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.jobs.requests import BatchRequest
from prefixgrove.jobs.tokenize import PromptTokenizer
from prefixgrove.jobs.tool_calls import split_reasoning, thinks, tool_format
from prefixgrove.settings import IngestSettings

TEMPLATES = Path(__file__).parent / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
# A conversation that already called a tool and got its result (Mistral wants 9-character ids).
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call00001", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
    {"role": "tool", "tool_call_id": "call00001", "content": "21 C, sunny"},
    {"role": "assistant", "content": "It is 21 C and sunny in Paris."},
    {"role": "user", "content": "And in Rome?"},
]  # fmt: skip
FAMILIES = {  # template file: (its tool-call format, whether its model thinks)
    "llama3.1": ("llama3_json", False), "qwen2.5": ("hermes", False),
    "mistral-v0.3": ("mistral", False), "qwen3": ("hermes", True),
    "deepseek-r1": (None, True),
}  # fmt: skip
REPLIES = {  # a reply in each format calling get_weather for Rome, and its content
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", '
                    '"unit": "C"}}', None),
    "hermes": ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", '
               '"unit": "C"}}\n</tool_call>', "Let me look.\n"),
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome", '
                '"unit": "C"}}]', None),
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer(MODEL, max_model_len=4096)


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def ingest(tokenizer: PromptTokenizer, family: str, **body: Any) -> BatchRequest | RequestError:
    """One chat line through validation and the family's chat template."""
    tokenizer.tokenizer.chat_template = template(family)
    line = {"custom_id": "c", "url": "/v1/chat/completions",
            "body": {"messages": HISTORY, "max_tokens": 8, **body}}  # fmt: skip
    batch = JobIngestor({MODEL: tokenizer}, IngestSettings()).add([json.dumps(line).encode()])
    if batch.errors:
        return batch.errors[0]
    [(request, tokens)] = batch.requests
    request.prompt_text = tokenizer.tokenizer.decode(tokens.tolist())  # what the model was shown
    return request


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_familys_template_says_its_tool_call_format_and_whether_it_thinks(
    family: str,
) -> None:
    assert (tool_format(template(family)), thinks(template(family))) == FAMILIES[family]


@pytest.mark.parametrize("family", ["llama3.1", "qwen2.5", "mistral-v0.3", "qwen3"])
def test_tools_and_a_called_tools_history_are_rendered_through_the_template(
    tokenizer: PromptTokenizer, family: str
) -> None:
    request = ingest(tokenizer, family, tools=[WEATHER, TIME])
    assert isinstance(request, BatchRequest), request
    shown = request.prompt_text or ""
    assert "get_weather" in shown and "get_time" in shown and "The weather in a city now" in shown
    assert "21 C, sunny" in shown and "And in Rome?" in shown
    assert request.params["tool_choice"] == "auto"
    assert request.params["tool_parser"] == FAMILIES[family][0]


def test_a_template_that_renders_no_tools_refuses_them_by_name(tokenizer: PromptTokenizer) -> None:
    error = ingest(tokenizer, "deepseek-r1", tools=[WEATHER])
    assert isinstance(error, RequestError) and error.code == "unsupported_field"
    assert "does not render tools" in error.message


def answer(tokenizer: PromptTokenizer, request: BatchRequest, text: str) -> dict[str, Any]:
    """The output line's body of a reply `text` (its token ids the tokenizer's), validated."""
    ids = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    completion = CompletionOutput(0, text, ids, "stop")
    out = RequestOutput("r", None, [1, 2, 3], [completion], True)
    line = success_line(0, "c", "chat", request.params, MODEL, out, tokenizer.tokenizer,
                        requested_model=None, tag=run_tag("job"))  # fmt: skip
    body = json.loads(line)["response"]["body"]
    ChatCompletion.model_validate(body, strict=True)
    return body


@pytest.mark.parametrize("family", ["llama3.1", "qwen2.5", "mistral-v0.3"])
def test_a_reply_in_the_familys_format_is_parsed_into_tool_calls(
    tokenizer: PromptTokenizer, family: str
) -> None:
    request = ingest(tokenizer, family, tools=[WEATHER])
    assert isinstance(request, BatchRequest)
    reply, content = REPLIES[FAMILIES[family][0]]
    [choice] = answer(tokenizer, request, reply)["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == content
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome", "unit": "C"}
    if family == "mistral-v0.3":  # its template takes back only 9 letters and digits
        assert len(call["id"]) == 9 and set(call["id"]) <= set(string.ascii_letters + string.digits)


@pytest.mark.parametrize("family", ["llama3.1", "qwen2.5", "mistral-v0.3"])
def test_a_plain_reply_or_tool_choice_none_is_text(tokenizer: PromptTokenizer, family: str) -> None:
    for choice, reply in (("auto", "It is sunny."), ("none", REPLIES[FAMILIES[family][0]][0])):
        request = ingest(tokenizer, family, tools=[WEATHER], tool_choice=choice)
        assert isinstance(request, BatchRequest)
        [out] = answer(tokenizer, request, reply)["choices"]
        assert out["message"]["content"] == reply and out["finish_reason"] == "stop"
        assert "tool_calls" not in out["message"]


def test_a_thinking_models_reasoning_is_apart_and_may_be_left_out(
    tokenizer: PromptTokenizer,
) -> None:
    reply = "<think>\nThe user wants Rome.\n</think>\n\nIt is 19 C in Rome."
    for family in ("qwen3", "deepseek-r1"):
        request = ingest(tokenizer, family, messages=[{"role": "user", "content": "Rome?"}])
        assert isinstance(request, BatchRequest)
        [out] = answer(tokenizer, request, reply.removeprefix("<think>"))["choices"]
        assert out["message"]["reasoning_content"] == "The user wants Rome."
        assert out["message"]["content"] == "It is 19 C in Rome."
    request = ingest(tokenizer, "qwen3", include_reasoning=False)
    assert isinstance(request, BatchRequest)
    [out] = answer(tokenizer, request, reply)["choices"]
    assert out["message"]["content"] == "It is 19 C in Rome."
    assert "reasoning_content" not in out["message"]


def test_qwen3_thinks_and_calls_tools_in_one_reply(tokenizer: PromptTokenizer) -> None:
    request = ingest(tokenizer, "qwen3", tools=[WEATHER])
    assert isinstance(request, BatchRequest)
    [out] = answer(tokenizer, request, "<think>Rome, Celsius.</think>\n\n" + REPLIES["hermes"][0])[
        "choices"
    ]
    assert out["message"]["reasoning_content"] == "Rome, Celsius."
    assert out["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert out["finish_reason"] == "tool_calls"


def test_thinking_switched_off_for_a_request_renders_an_empty_think_block(
    tokenizer: PromptTokenizer,
) -> None:
    request = ingest(tokenizer, "qwen3", chat_template_kwargs={"enable_thinking": False})
    assert isinstance(request, BatchRequest)
    assert (request.prompt_text or "").endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert split_reasoning("no thinking here") == (None, "no thinking here")


@pytest.mark.parametrize(
    ("body", "named"),
    [({"tool_choice": "required"}, "needs tools"),
     ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
      "tool_choice must be"),
     ({"tools": [WEATHER, WEATHER]}, "names of their own"),
     ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
      "both constrain"),
     ({"include_reasoning": "yes"}, "include_reasoning must be a boolean")],
)  # fmt: skip
def test_tool_fields_that_cannot_work_are_refused_naming_why(
    tokenizer: PromptTokenizer, body: dict, named: str
) -> None:
    error = ingest(tokenizer, "qwen2.5", **body)
    assert isinstance(error, RequestError) and error.code == "invalid_value", error
    assert named in error.message
