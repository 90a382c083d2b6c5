"""vLLM's offline examples (examples/offline_inference: basic, generate, chat, automatic prefix caching,
n samples) as their users run them, with only the import changed, on SmolLM2 on the CPU. Few tokens
each: what is checked is that the scripts' calls and the fields they read work here."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_trained_model import MODEL, model_file  # noqa: F401 (the fixture that finds the model)

from prefixgrove import LLM, RequestOutput, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]
# automatic_prefix_caching.py's shape: a long shared document, then one question per prompt.
TABLE = "\n".join(
    f"| {i} | Person{i} | {20 + i} | Job{i % 7} | Country{i % 5} |" for i in range(1, 31)
)
LONG_PROMPT = (
    "You are a helpful assistant in recognizes the content of tables in markdown format. Here is a "
    "table as follows.\n# Table\n| ID | Name | Age | Occupation | Country |\n|---|---|---|---|---|\n"
    + TABLE
)
QUESTIONS = [
    "Question: what is the age of Person3? Your answer: The age of Person3 is ",
    "Question: what is the age of Person17? Your answer: The age of Person17 is ",
]


@pytest.fixture(scope="module")
def llm(model_file: str) -> LLM:  # noqa: F811
    # a KV cache of 8,192 tokens, not the CPU default's 65,536 (3 GB for SmolLM2)
    return LLM(
        model=MODEL,
        device="cpu",
        dtype="float32",
        enable_prefix_caching=True,
        num_gpu_blocks_override=512,
    )


def print_outputs(outputs: list[RequestOutput]) -> None:
    """The examples' loop over what generate returns."""
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")


def test_basic_generate(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8)
    outputs = llm.generate(PROMPTS, sampling_params)
    print_outputs(outputs)
    printed = capsys.readouterr().out.splitlines()
    assert [o.prompt for o in outputs] == PROMPTS
    assert len(printed) == len(PROMPTS)
    assert all(f"{p!r}" in line for p, line in zip(PROMPTS, printed, strict=True))
    assert all(o.outputs[0].token_ids and o.finished for o in outputs)


def test_generate_with_the_default_sampling_params(llm: LLM) -> None:
    sampling_params = llm.get_default_sampling_params()
    sampling_params.max_tokens = 4
    outputs = llm.generate(PROMPTS, sampling_params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) <= 4 for o in outputs] == [True] * len(PROMPTS)


def test_chat_one_conversation_then_a_batch(llm: LLM) -> None:
    sampling_params = SamplingParams(temperature=0.5, max_tokens=6)
    [one] = llm.chat(CONVERSATION, sampling_params, use_tqdm=False)
    batch = llm.chat([CONVERSATION for _ in range(3)], sampling_params, use_tqdm=True)
    assert [o.prompt for o in batch] == [one.prompt] * 3
    assert one.prompt is not None and one.prompt.endswith("<|im_start|>assistant\n")
    assert all(o.outputs[0].token_ids for o in [one, *batch])


def test_chat_with_a_chat_template_read_from_a_file(llm: LLM, tmp_path: Path) -> None:
    template_path = tmp_path / "template.jinja"
    template_path.write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    )
    with open(template_path) as f:
        chat_template = f.read()
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    [out] = llm.chat(CONVERSATION, greedy, use_tqdm=False, chat_template=chat_template)
    assert out.prompt is not None
    assert out.prompt.startswith("[system] You are a helpful assistant\n")
    assert out.prompt.endswith("[assistant] ")


def test_automatic_prefix_caching(llm: LLM) -> None:
    """The example's shape: one long document, one question per generate call. A later call finds
    the document's KV in the cache, and a greedy prompt asked again gets the same answer."""
    sampling_params = SamplingParams(temperature=0, max_tokens=6)
    first = llm.generate(LONG_PROMPT + QUESTIONS[0], sampling_params=sampling_params)
    other = llm.generate(LONG_PROMPT + QUESTIONS[1], sampling_params=sampling_params)
    again = llm.generate(LONG_PROMPT + QUESTIONS[0], sampling_params=sampling_params)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert again[0].outputs[0].text == first[0].outputs[0].text
    document = len(llm.get_tokenizer().encode(LONG_PROMPT))
    block = llm.config.cache.block_size
    for later in (other[0], again[0]):
        assert later.num_cached_tokens >= document // block * block


def test_n_samples_per_prompt(llm: LLM) -> None:
    sampling_params = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_tokens=4, seed=0)
    outputs = llm.generate(PROMPTS[:2], sampling_params, use_tqdm=False)
    assert len(outputs) == 2
    for output in outputs:
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert all(c.token_ids for c in output.outputs)
        assert output.metrics is not None and output.metrics.finished_time is not None
