"""tool_choice "required" and a named function are enforced with structured outputs, as vLLM enforces
them: even a model of random weights answers with tool calls of the request's tools whose arguments
validate against their schemas; `LLM.chat(tools=...)` renders the tools through the template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from engine_checkpoints import save_checkpoint
from openai.types.chat import ChatCompletion
from services_testbed import batch_line
from transformers import AutoTokenizer

from prefixgrove import LLM, SamplingParams
from prefixgrove.engine_settings import EngineSettings
from prefixgrove.local import run_local
from prefixgrove.settings import IngestSettings

TEMPLATE = Path(__file__).parents[1] / "jobs" / "chat_templates" / "qwen2.5.jinja"
WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                     "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"]}}  # fmt: skip
TIME = {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}  # fmt: skip
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, TIME)]
# no whitespace token (the byte tokenizer's space, tab, newline, return): on random weights free
# JSON whitespace could run to max_tokens
NO_WHITESPACE = {"32": -100, "9": -100, "10": -100, "13": -100}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama whose chat template is Qwen2.5's (Hermes tool calls)."""
    path = tmp_path_factory.mktemp("tools-model")
    save_checkpoint("llama3", path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer.save_pretrained(path)
    return str(path)


def chat(custom_id: str, **fields: Any) -> str:
    body = {"messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": TOOLS,
            "max_tokens": 60, "temperature": 0, "logit_bias": NO_WHITESPACE, **fields}  # fmt: skip
    return batch_line(custom_id, body, "/v1/chat/completions")


def test_required_and_named_tool_choices_answer_with_valid_calls(model: str, tmp_path: Path):
    job = tmp_path / "in.jsonl"
    named = {"type": "function", "function": {"name": "get_weather"}}
    lines = [chat("required", tool_choice="required", parallel_tool_calls=False),
             chat("named", tool_choice=named), chat("auto", max_tokens=4)]  # fmt: skip
    job.write_text("".join(line + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    engine = EngineSettings(device="cpu", dtype="float32")
    run_local(job, out, tmp_path / "err.jsonl", model, IngestSettings(), engine, use_tqdm=False)
    bodies = {
        line["custom_id"]: line["response"]["body"]
        for line in map(json.loads, out.read_text().splitlines())
    }
    assert sorted(bodies) == ["auto", "named", "required"]
    for body in bodies.values():
        ChatCompletion.model_validate(body, strict=True)
    schemas = {f["name"]: f["parameters"] for f in (WEATHER, TIME)}
    for custom_id, finish in (("required", "tool_calls"), ("named", "stop")):
        [choice] = bodies[custom_id]["choices"]
        assert choice["finish_reason"] == finish and choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        name = call["function"]["name"]
        assert name in schemas and (custom_id == "required" or name == "get_weather")
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])


def test_llm_chat_renders_the_tools_through_the_template(model: str) -> None:
    llm = LLM(model, device="cpu", dtype="float32", num_gpu_blocks_override=64)
    [out] = llm.chat([{"role": "user", "content": "Weather?"}], SamplingParams(max_tokens=1),
                     use_tqdm=False, tools=TOOLS)  # fmt: skip
    assert out.prompt is not None and '"name": "get_weather"' in out.prompt
    assert "<tools>" in out.prompt
