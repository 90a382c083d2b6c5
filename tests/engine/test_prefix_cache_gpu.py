"""The prefix cache on a real GPU, in fp32: with everything the CUDA path runs (Triton kernels, fused
cascade prefill, one-pass cascade decode, CUDA graphs, decode windows, async scheduling), a job run
twice gives the tokens of the job run alone, its requests ungrouped and uncached."""

from __future__ import annotations

import gc

import pytest
import torch
from engine_checkpoints import random_prompts, save_checkpoint

from prefixgrove import LLM, RequestOutput, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_checkpoint("llama3", tmp_path_factory.mktemp("llama3"))


def _job() -> list[list[int]]:
    """A 300-token system prompt, three documents, four questions of uneven lengths each."""
    system = random_prompts([300], seed=1)[0]
    docs = random_prompts([100, 150, 200], seed=2)
    questions = random_prompts([5, 17, 30, 41], seed=3)
    return [system + doc + q for doc in docs for q in questions]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[RequestOutput]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_a_job_run_twice_on_the_cuda_path_gives_the_tokens_of_its_requests_alone(checkpoint):
    prompts = _job()
    alone = LLM(
        checkpoint,
        dtype="float32",
        enable_prefix_grouping=False,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.3,
    )
    expected = [o.outputs[0].token_ids for o in _generate(alone, prompts)]
    del alone
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(checkpoint, dtype="float32", gpu_memory_utilization=0.3)
    assert llm.engine.runner.graphs is not None
    first, second = _generate(llm, prompts), _generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in second] == expected
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // 16 * 16 for p in prompts]
    blocks = llm.engine.blocks
    assert blocks.num_free == blocks.num_usable
