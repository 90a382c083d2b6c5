"""SamplingParams.prompt_logprobs as vLLM returns them: None for the first prompt token, then per token
its log-probability under transformers' own forward, its rank and the top k; whole on every path
(chunked prefill, prefix groups, n samples)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_checkpoints import build_model, engine, greedy, random_prompts, run, save_checkpoint
from test_trained_model import MODEL, model_file  # noqa: F401 (the fixture that finds the model)
from transformers import AutoModelForCausalLM, PreTrainedModel

from prefixgrove import LLM, RequestOutput, SamplingParams

K = 3
# fp32 on both sides, only the order of sums differs (test_hf_parity measures and explains 1e-4)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf_model() -> PreTrainedModel:
    return build_model("llama3")


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_checkpoint("llama3", tmp_path_factory.mktemp("llama3"))


@pytest.fixture(scope="module")
def llm(path: str) -> LLM:
    """Chunks of 32 tokens: a long prompt is scored over several steps."""
    return engine(path, max_num_batched_tokens=32, max_num_seqs=8)


def hf_prompt_logprobs(model: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p - 1 is the distribution of prompt token p."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return logits.float().log_softmax(dim=-1)


def assert_matches_transformers(model: PreTrainedModel, out: RequestOutput, k: int) -> None:
    prompt, entries = out.prompt_token_ids, out.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    expected = hf_prompt_logprobs(model, prompt)
    for p in range(1, len(prompt)):
        entry, row, token = entries[p], expected[p - 1], prompt[p]
        assert entry is not None
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=TOLERANCE)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(k)
        assert set(entry) == set(top.indices.tolist()) | {token}, f"position {p}"
        for rank, (tid, value) in enumerate(
            zip(top.indices.tolist(), top.values.tolist(), strict=True), start=1
        ):
            assert entry[tid].logprob == pytest.approx(value, abs=TOLERANCE)
            assert tid == token or entry[tid].rank == rank


def test_prompt_logprobs_match_transformers_across_chunks(llm: LLM, hf_model: PreTrainedModel):
    prompts = random_prompts([1, 7, 33, 70], seed=21)
    outs = run(llm, prompts, greedy(2, prompt_logprobs=K))
    assert outs[0].prompt_logprobs == [None]
    for out in outs[1:]:
        assert_matches_transformers(hf_model, out, K)


def test_prompt_logprobs_match_transformers_on_the_triton_backend(
    path: str, hf_model: PreTrainedModel
):
    """The kernels in Triton's interpreter here: few, short prompts, one of them over two chunks."""
    llm = engine(path, attention_backend="triton", max_num_batched_tokens=32, max_num_seqs=8)
    for out in run(llm, random_prompts([7, 40], seed=28), greedy(1, prompt_logprobs=K)):
        assert_matches_transformers(hf_model, out, K)


def test_prompt_logprobs_zero_gives_the_prompt_tokens_alone(llm: LLM):
    [out] = run(llm, random_prompts([9], seed=22), greedy(1, prompt_logprobs=0))
    assert out.prompt_logprobs is not None
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in out.prompt_token_ids[1:]]


def test_without_prompt_logprobs_there_are_none(llm: LLM):
    [out] = run(llm, random_prompts([9], seed=22), greedy(1))
    assert out.prompt_logprobs is None


def test_a_grouped_request_gets_the_logprobs_of_the_shared_prefix_too(
    llm: LLM, hf_model: PreTrainedModel
):
    """It runs outside the group; the group's other requests still share the prefix."""
    shared = random_prompts([48], seed=23)[0]
    prompts = [shared + tail for tail in random_prompts([4, 6, 5], seed=24)]
    params = [greedy(2), greedy(2, prompt_logprobs=K), greedy(2)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert outs[0].num_cached_tokens > 0 and outs[2].num_cached_tokens > 0
    assert outs[1].num_cached_tokens == 0
    assert_matches_transformers(hf_model, outs[1], K)
    assert outs[0].prompt_logprobs is None and outs[2].prompt_logprobs is None


def test_n_samples_report_the_prompt_logprobs_once(llm: LLM, hf_model: PreTrainedModel):
    prompt = random_prompts([40], seed=25)[0]
    params = SamplingParams(n=3, max_tokens=2, seed=4, prompt_logprobs=K)
    [out] = run(llm, [prompt], params)
    assert len(out.outputs) == 3
    assert_matches_transformers(hf_model, out, K)


def test_each_logprob_names_its_token(llm: LLM):
    [out] = run(llm, random_prompts([6], seed=26), greedy(1, prompt_logprobs=2))
    tokenizer = llm.get_tokenizer()
    assert out.prompt_logprobs is not None
    for entry in out.prompt_logprobs[1:]:
        assert entry is not None
        for tid, logprob in entry.items():
            assert logprob.decoded_token == tokenizer.decode([tid])


def test_preempted_requests_are_scored_once_and_whole(path: str, hf_model: PreTrainedModel):
    """Each request ends at 20 + 40 tokens = 4 blocks of 16; four need 16 of 8 usable blocks, so
    some are preempted and their prompts computed again."""
    prompts = random_prompts([20] * 4, seed=27)
    llm = engine(path, num_gpu_blocks_override=9)
    outs = run(llm, prompts, greedy(40, ignore_eos=True, prompt_logprobs=K))
    assert llm.engine.metrics.preemptions > 0
    for out in outs:
        assert_matches_transformers(hf_model, out, K)


@pytest.mark.slow
def test_prompt_logprobs_match_transformers_on_the_trained_model(model_file: str):  # noqa: F811
    """SmolLM2 from its GGUF file on both sides: trained logits, with their close calls (measured
    at most 2e-5 apart over this prompt). Slow: the default run covers its path with
    test_prompt_logprobs_match_transformers_across_chunks (the tiny checkpoint against
    transformers' forward) and SmolLM2's parity with transformers in test_trained_model.py."""
    gguf = Path(model_file)
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    llm = LLM(MODEL, device="cpu", dtype="float32", attention_backend="torch")
    prompt = llm.get_tokenizer().encode(
        "The capital of France is Paris, and the capital of Spain is"
    )
    [out] = run(llm, [prompt], greedy(1, prompt_logprobs=K))
    assert_matches_transformers(hf, out, K)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_an_invalid_prompt_logprobs_is_refused(value: object):
    with pytest.raises(ValueError, match=r"SamplingParams.prompt_logprobs=.* is invalid"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]
