"""`LLM.chat` as vLLM's: the model's chat template applied exactly as transformers applies it, one
conversation or a batch, continuing a final message; and every output carries its prompt text."""

from __future__ import annotations

import pytest
from test_trained_model import MODEL, model_file  # noqa: F401 (the fixture that finds the model)

from prefixgrove import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(model_file: str) -> LLM:  # noqa: F811
    # a KV cache of 8,192 tokens, not the CPU default's 65,536 (3 GB for SmolLM2)
    return LLM(MODEL, dtype="float32", attention_backend="torch", num_gpu_blocks_override=512)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def test_one_conversation_is_rendered_as_transformers_renders_it(llm: LLM) -> None:
    expected = llm.get_tokenizer().apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    [out] = llm.chat(QUESTION, greedy(8), use_tqdm=False)
    assert out.prompt_token_ids == expected
    assert out.prompt is not None and out.prompt.endswith("<|im_start|>assistant\n")
    assert "Paris" in out.outputs[0].text


def test_a_batch_of_conversations_answers_each_in_order(llm: LLM) -> None:
    other = [{"role": "system", "content": "Answer in one word."}, *QUESTION]
    outs = llm.chat([QUESTION, other], greedy(8), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [
        llm.chat(c, greedy(1), use_tqdm=False)[0].prompt_token_ids for c in (QUESTION, other)
    ]


def test_continue_final_message_extends_the_assistant_reply(llm: LLM) -> None:
    started = [*QUESTION, {"role": "assistant", "content": "The capital of France"}]
    [out] = llm.chat(
        started,
        greedy(4),
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert out.prompt is not None and out.prompt.endswith("The capital of France")
    assert out.outputs[0].text.startswith(" is")


def test_starting_and_continuing_a_reply_at_once_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(QUESTION, add_generation_prompt=True, continue_final_message=True)


def test_a_chat_template_given_by_the_caller_replaces_the_models(llm: LLM) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    [out] = llm.chat(QUESTION, greedy(1), use_tqdm=False, chat_template=template)
    assert out.prompt == "[user] What is the capital of France?\n"


def test_grouped_requests_keep_their_prompt_text() -> None:
    llm = LLM("tiny-random-llama", attention_backend="torch")
    prompts = ["One long system prompt that every request shares. " * 4 + f"Q{i}" for i in range(4)]
    outs = llm.generate(prompts, greedy(2), use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in outs)
    assert [o.prompt for o in outs] == prompts
