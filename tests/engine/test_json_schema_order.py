"""JSON-schema outputs as vLLM and OpenAI give them: properties in the order the schema lists them, at
every level of nesting ("reasoning" before "answer"), never a key the schema did not name unless it
allows others, and a schema's spacing (not its key order) irrelevant to which grammar compiles."""

from __future__ import annotations

import json
from typing import Any

import pytest

from prefixgrove import LLM, SamplingParams, StructuredOutputsParams
from prefixgrove.catalog.presets import load_tokenizer
from prefixgrove.engine.structured.grammars import GrammarCompiler

MODEL = "tiny-random-llama"
# Keys in anything but alphabetical order, an object nested in the middle, and values of few tokens
# each, so random weights end every output well within max_tokens.
NESTED = {
    "type": "object",
    "properties": {
        "zeta": {"enum": ["z1", "z2"]},
        "reasoning": {"type": "string", "maxLength": 8},
        "middle": {
            "type": "object",
            "properties": {"y": {"type": "boolean"}, "b": {"type": "integer", "maximum": 99}},
            "required": ["y", "b"],
        },
        "answer": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["zeta", "reasoning", "middle", "answer"],
}
REASONING_FIRST = {
    "type": "object",
    "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
    "required": ["reasoning", "answer"],
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, device="cpu", dtype="float32", num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = load_tokenizer(MODEL)
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def key_order(value: Any) -> list[Any]:
    """Each object's keys in the order they were written, depth first."""
    if not isinstance(value, list) or not value or not isinstance(value[0], tuple):
        return []
    return [[k for k, _ in value], *(order for _, v in value for order in key_order(v))]


def accepts(compiler: GrammarCompiler, schema: dict[str, Any], text: str) -> bool:
    """Whether the compiled schema's grammar takes every token of `text`."""
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(json=schema)))
    ids = compiler._hf.encode(text, add_special_tokens=False)
    return bool(matcher.validate_tokens(ids) == len(ids))


def test_generated_objects_keep_the_schemas_property_order_at_every_level(llm: LLM) -> None:
    constraint = StructuredOutputsParams(json=NESTED, disable_any_whitespace=True)
    params = SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=constraint)
    outputs = llm.generate(["Answer:", "Q", "What now?"], params, use_tqdm=False)
    for out in outputs:
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        written = json.loads(text, object_pairs_hook=list)
        assert key_order(written) == [["zeta", "reasoning", "middle", "answer"], ["y", "b"]], text


def test_only_the_schemas_order_is_accepted(compiler: GrammarCompiler) -> None:
    assert accepts(compiler, REASONING_FIRST, '{"reasoning": "because", "answer": 2}')
    assert not accepts(compiler, REASONING_FIRST, '{"answer": 2, "reasoning": "because"}')


def test_no_key_the_schema_did_not_name_unless_it_allows_others(compiler: GrammarCompiler) -> None:
    extra = '{"reasoning": "r", "answer": 2, "note": 1}'
    assert not accepts(compiler, REASONING_FIRST, extra)
    nested_extra = (
        '{"zeta": "z1", "reasoning": "", "middle": {"y": true, "b": 1, "c": 2}, "answer": 1}'
    )
    assert not accepts(compiler, NESTED, nested_extra)
    assert accepts(compiler, {**REASONING_FIRST, "additionalProperties": True}, extra)


def test_default_whitespace_is_free_and_disable_any_whitespace_allows_none(
    compiler: GrammarCompiler,
) -> None:
    spaced = '{\n  "reasoning" : "r",\n  "answer": 2\n}'
    assert accepts(compiler, REASONING_FIRST, spaced)
    compact = StructuredOutputsParams(json=REASONING_FIRST, disable_any_whitespace=True)
    matcher = compiler.matcher(compiler.compile(compact))
    ids = compiler._hf.encode(spaced, add_special_tokens=False)
    assert matcher.validate_tokens(ids) < len(ids)


def test_spacing_does_not_make_another_grammar_but_key_order_does() -> None:
    spaced = StructuredOutputsParams(json=json.dumps(REASONING_FIRST, indent=2))
    assert spaced.key == StructuredOutputsParams(json=REASONING_FIRST).key
    reordered = {
        **REASONING_FIRST,
        "properties": dict(reversed(REASONING_FIRST["properties"].items())),
    }
    assert StructuredOutputsParams(json=reordered).key != spaced.key
