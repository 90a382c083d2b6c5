"""vLLM's import paths and attributes, so that a script ports by changing its `vllm` imports:
prefixgrove.sampling_params, .inputs, .outputs, .utils, .distributed and EngineArgs; `llm.llm_engine`,
`reset_prefix_cache()`, `LLM(seed=None)`, `trust_remote_code=True`, `lora_request=None`,
`priority=`, `SamplingParams.clone()`, GuidedDecodingParams; and vLLM's methods that are not served
fail with one error naming what is."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from engine_checkpoints import greedy

from prefixgrove import LLM, EngineArgs, SamplingParams
from prefixgrove.engine import LLMEngine
from prefixgrove.inputs import TextPrompt, TokensPrompt
from prefixgrove.outputs import CompletionOutput, RequestOutput
from prefixgrove.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from prefixgrove.utils import FlexibleArgumentParser

MODEL = "tiny-random-llama"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, device="cpu", dtype="float32", seed=None, trust_remote_code=True)


def test_vllm_import_paths_give_the_engines_own_types() -> None:
    from prefixgrove import engine

    assert SamplingParams is engine.SamplingParams
    assert StructuredOutputsParams is engine.StructuredOutputsParams
    assert (RequestOutput, CompletionOutput) == (engine.RequestOutput, engine.CompletionOutput)


def test_text_and_tokens_prompts_generate(llm: LLM) -> None:
    prompts = [TextPrompt(prompt="Hello"), TokensPrompt(prompt_token_ids=[1, 2, 3])]
    outputs = llm.generate(prompts, greedy(2), use_tqdm=False)
    assert [o.prompt for o in outputs] == ["Hello", None]
    assert outputs[1].prompt_token_ids == [1, 2, 3]


def test_a_prompt_with_multimodal_data_is_refused_by_name(llm: LLM) -> None:
    prompt = {"prompt": "Describe", "multi_modal_data": {"image": object()}}
    with pytest.raises(ValueError, match="prompt 0: multi_modal_data not supported"):
        llm.generate([prompt], greedy(2), use_tqdm=False)


def test_llm_engine_and_reset_prefix_cache(llm: LLM) -> None:
    assert isinstance(llm.llm_engine, LLMEngine) and llm.llm_engine is llm.engine
    prompt = {"prompt_token_ids": list(range(1, 70))}
    llm.generate([prompt], greedy(1), use_tqdm=False)
    [cached] = llm.generate([prompt], greedy(1), use_tqdm=False)
    assert cached.num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    [fresh] = llm.generate([prompt], greedy(1), use_tqdm=False)
    assert fresh.num_cached_tokens == 0


def test_seed_none_is_the_engines_default_seed() -> None:
    """vLLM's default since 0.11; here the engine is deterministic whatever its seed."""
    params = SamplingParams(max_tokens=6, temperature=1.0)
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    runs = [
        LLM(MODEL, device="cpu", dtype="float32", seed=seed).generate(
            prompt, params, use_tqdm=False
        )
        for seed in (None, 0, 1)
    ]
    tokens = [r[0].outputs[0].token_ids for r in runs]
    assert tokens[0] == tokens[1] != tokens[2]


def test_lora_request_none_and_equal_priorities_are_taken(llm: LLM) -> None:
    prompts = ["a", "b"]
    outputs = llm.generate(prompts, greedy(1), use_tqdm=False, lora_request=None, priority=[0, 0])
    assert len(outputs) == 2
    chat = [{"role": "user", "content": "hi"}]
    assert llm.chat(chat, greedy(1), use_tqdm=False, lora_request=None)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("options", "named"),
    [({"lora_request": object()}, "lora_request=.* is not supported"),
     ({"priority": [1, 0]}, r"priority=\[1, 0\] is not supported"),
     ({"priority": [0]}, r"priority=\[0\] is not supported")],
)  # fmt: skip
def test_an_adapter_or_unequal_priorities_are_refused_by_name(
    llm: LLM, options: dict, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        llm.generate(["a", "b"], greedy(1), use_tqdm=False, **options)


@pytest.mark.parametrize("method", ["beam_search", "encode", "classify", "score", "reward"])
def test_vllms_methods_that_are_not_served_name_what_is(llm: LLM, method: str) -> None:
    with pytest.raises(
        NotImplementedError, match=rf"LLM.{method} is not supported.*offers generate, chat"
    ):
        getattr(llm, method)(["a"])


def test_clone_is_a_deep_copy() -> None:
    params = SamplingParams(stop=["x"], logit_bias={3: 1.0}, structured_outputs={"choice": ["a"]})
    copy = params.clone()
    assert copy == params and copy is not params
    copy.logit_bias[3] = 5.0  # type: ignore[index]
    assert params.logit_bias == {3: 1.0}


def test_guided_decoding_is_structured_outputs_under_its_older_name(llm: LLM) -> None:
    guided = GuidedDecodingParams(choice=["yes", "no"], backend="guidance")
    params = SamplingParams(guided_decoding=guided, temperature=0)
    assert params.structured_outputs is guided
    [out] = llm.generate(["Answer:"], params, use_tqdm=False)
    assert out.outputs[0].text in ("yes", "no")
    with pytest.raises(ValueError, match="backend='xgrammar' is not supported"):
        GuidedDecodingParams(choice=["a"], backend="xgrammar")
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(guided_decoding=guided, structured_outputs={"regex": "a"})


def test_engine_args_flags_are_llm_keywords_at_llms_defaults() -> None:
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(
        ["--model", MODEL, "--max_num_seqs", "4", "--no-enable-prefix-caching"]
    )
    assert (args.max_num_seqs, args.enable_prefix_caching, args.seed) == (4, False, 0)
    from_flags = LLM(**vars(args))
    assert from_flags.config.enable_prefix_caching is False
    assert EngineArgs.from_cli_args(args) == EngineArgs(
        model=MODEL, max_num_seqs=4, enable_prefix_caching=False
    )
    as_dict = dataclasses.asdict(EngineArgs(model=MODEL))
    assert LLM(**as_dict).config.model.model == MODEL
    assert isinstance(parser, argparse.ArgumentParser)
