"""Text in, text out with the tiny preset's byte-level tokenizer."""

from __future__ import annotations

import pytest
from engine_checkpoints import engine

from prefixgrove import LLM, SamplingParams

TEXTS = ["Hello, world!", "grüße aus dem Hain 🌳", "a\nb\tc  ", "x"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return engine("tiny-random-llama")


def test_prompt_token_ids_decode_back_to_the_prompt(llm: LLM):
    tokenizer = llm.get_tokenizer()
    outs = llm.generate(TEXTS, SamplingParams(max_tokens=1), use_tqdm=False)
    for text, out in zip(TEXTS, outs, strict=True):
        assert out.prompt == text
        assert tokenizer.decode(out.prompt_token_ids) == text
        assert len(out.prompt_token_ids) == len(text.encode())


def test_output_text_is_the_decoded_output_tokens(llm: LLM):
    tokenizer = llm.get_tokenizer()
    outs = llm.generate(
        TEXTS, SamplingParams(max_tokens=24, temperature=0.8, seed=3), use_tqdm=False
    )
    for out in outs:
        completion = out.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_prompt_dict_with_text_is_tokenized(llm: LLM):
    out = llm.generate([{"prompt": "abc"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids == list(b"abc")


def test_detokenize_false_returns_tokens_without_text(llm: LLM):
    out = llm.generate(
        ["abc"], SamplingParams(max_tokens=5, detokenize=False, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].text == ""
