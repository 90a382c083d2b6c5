"""On a real trained model (SmolLM2-135M-Instruct from its GGUF file) the engine computes what
transformers computes from the same file: the same greedy tokens, grouped or not, on both attention
backends (the Triton kernels' run is marked slow), in fp32 on the CPU. Trained weights have the close
calls between top tokens that random weights lack, so this is the parity check that matters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checkpoints import SharedEngines, chat_ids, engine, smollm2_file
from transformers import AutoModelForCausalLM

from prefixgrove import LLM, SamplingParams

MODEL = "smollm2-135m-instruct"
SYSTEM = (
    "You are a concise assistant for a botanical garden. It opens at 9:00 and closes at 18:00, "
    "Tuesday to Sunday. Tickets cost 12 euros for adults and 6 euros for children."
)
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "When does the garden open?",
    "How much is a child ticket?", "Name three colours.", "What is two plus two?",
    "Is the garden open on Monday?", "Say hello in Spanish.", "What do bees make?",
    "Give me a word that rhymes with cat.", "What is the largest planet?", "Who wrote Hamlet?",
    "What season comes after winter?", "How many legs does a spider have?",
    "What is water made of?", "Suggest a name for a cat.",
]  # fmt: skip
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def model_file() -> str:
    return smollm2_file()


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any) -> list[list[int]]:
    """Chat prompts that share one system prompt, so grouping has a real prefix to share."""
    return chat_ids(smollm2_tokenizer, [(SYSTEM, q) for q in QUESTIONS])


@pytest.fixture(scope="module")
def expected(model_file: str, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' own GGUF loading and greedy generate, one prompt at a time."""
    path = Path(model_file)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
            )
        out.append(generated[0, len(prompt) :].tolist())
    return out


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if llm.config.enable_prefix_grouping:
        assert sum(o.num_cached_tokens for o in outs) > 0, "the shared system prompt was not shared"
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "options", [{}, {"enable_prefix_grouping": False}], ids=["grouped", "ungrouped"]
)
def test_greedy_tokens_match_transformers_on_the_trained_model(
    prompts: list[list[int]],
    expected: list[list[int]],
    options: dict[str, bool],
    smollm2_engines: SharedEngines,
) -> None:
    llm = smollm2_engines(attention_backend="torch", **options)
    for question, got, want in zip(
        QUESTIONS, _greedy(llm, prompts, MAX_TOKENS), expected, strict=True
    ):
        assert got == want, question


@pytest.mark.slow(
    reason="its path is covered by the default run: the Triton kernels against transformers in "
    "test_hf_parity.py::test_greedy_tokens_match_transformers_on_triton_backend, on grouped batches "
    "in test_groups.py::test_grouped_cascade_on_triton_backend_matches_ungrouped, and this model "
    "against transformers in test_greedy_tokens_match_transformers_on_the_trained_model"
)
def test_triton_kernels_match_transformers_on_the_trained_model(
    prompts: list[list[int]], expected: list[list[int]]
) -> None:
    """The Triton kernels (cascade prefix pass, paged decode) on a grouped batch. Triton's CPU
    interpreter runs a 30-layer step in seconds, so this takes a few prompts and tokens; a greedy
    continuation's first tokens are the shorter run's tokens."""
    few, tokens = 2, 6
    llm = engine(MODEL, attention_backend="triton")
    got = _greedy(llm, prompts[:few], tokens)
    assert got == [want[:tokens] for want in expected[:few]]


def test_the_trained_model_answers_a_question(smollm2_engines: SharedEngines) -> None:
    llm = smollm2_engines(attention_backend="torch")
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
