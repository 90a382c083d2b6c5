"""The engine computes what transformers computes: same greedy tokens, same log-probabilities (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from engine_checkpoints import (
    ARCHES,
    EOS_IDS,
    engine,
    greedy,
    random_prompts,
    run,
    save_model,
)
from transformers import PreTrainedModel

from prefixgrove import CompletionOutput

# Several lengths in one call: below, at and across block boundaries (block_size 16).
LENGTHS = (1, 7, 16, 33, 70)
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=list(ARCHES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, str(path), save_model(request.param, path)


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' own generate; it stops at the config's EOS ids, as the engine does by default."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens
        )
    return out[0, len(prompt) :].tolist()


def hf_logprobs(model: PreTrainedModel, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at the positions that produced each generated token."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(dim=-1)


def assert_logprobs_match(
    model: PreTrainedModel, prompt: list[int], completion: CompletionOutput, top: int = 0
) -> None:
    """Each generated token's logprob, and those of the `top` likeliest tokens at its step, within
    1e-4 of transformers' log_softmax (test_logprobs_match_transformers_log_softmax says why)."""
    tokens = completion.token_ids
    expected = hf_logprobs(model, prompt, tokens)
    assert completion.logprobs is not None and len(completion.logprobs) == len(tokens)
    for step, (token, entry) in enumerate(zip(tokens, completion.logprobs, strict=True)):
        assert entry[token].logprob == pytest.approx(expected[step, token].item(), abs=1e-4)
        best = expected[step].topk(top)
        for tid, value in zip(best.indices.tolist(), best.values.tolist(), strict=True):
            assert tid in entry, f"step {step}: top-{top} token {tid} missing"
            assert entry[tid].logprob == pytest.approx(value, abs=1e-4)


def test_greedy_tokens_match_transformers_generate(checkpoint):
    arch, path, model = checkpoint
    prompts = random_prompts(LENGTHS, seed=1)
    outs = run(engine(path, attention_backend="torch"), prompts, greedy(MAX_TOKENS))
    for prompt, out in zip(prompts, outs, strict=True):
        expected = hf_greedy(model, prompt, MAX_TOKENS)
        assert out.outputs[0].token_ids == expected, f"{arch}, prompt of {len(prompt)} tokens"
        ended_on_eos = expected[-1] in EOS_IDS
        assert out.outputs[0].finish_reason == ("stop" if ended_on_eos else "length")


def test_greedy_tokens_match_transformers_on_triton_backend(checkpoint):
    """Small on purpose: the kernels run in Triton's interpreter here."""
    arch, path, model = checkpoint
    llm = engine(path, attention_backend="triton")
    assert llm.engine.runner.backend.name == "triton"
    prompts = random_prompts((5, 21), seed=2)
    outs = run(llm, prompts, greedy(4))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 4), f"{arch}, {len(prompt)}"


def test_logprobs_match_transformers_log_softmax(checkpoint):
    """fp32 on both sides, so only the order of sums differs: measured at most 7e-6 over these
    architectures (logits spread ~1.2). 1e-4 leaves a 15x margin and is still far below what a real
    mistake costs: dropping the llama3 rope scaling moves logprobs by 1.3, zeroing Qwen2's qkv biases
    by 4."""
    _, path, model = checkpoint
    prompts = random_prompts((9, 40), seed=3)
    outs = run(engine(path), prompts, greedy(6, ignore_eos=True, logprobs=5))
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.outputs[0].token_ids) == 6
        assert_logprobs_match(model, prompt, out.outputs[0], top=5)
