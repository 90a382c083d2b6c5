"""Random jobs under random engine limits: whatever the scheduler does, every request gets the same
completion as it does with every limit far away and no grouping."""

from __future__ import annotations

import random

import engine_checkpoints as ckpt
import pytest

from prefixgrove import RequestOutput, SamplingParams


def _params(rng: random.Random) -> SamplingParams:
    n = rng.randint(1, 12)
    kind = rng.randrange(5)
    if kind == 0:
        return ckpt.greedy(n, ignore_eos=True)
    if kind == 1:
        return SamplingParams(
            max_tokens=n,
            temperature=rng.choice([0.5, 1.0]),
            top_k=rng.choice([0, 5]),
            top_p=rng.choice([1.0, 0.8]),
            seed=rng.randrange(100),
            ignore_eos=True,
        )
    if kind == 2:
        return ckpt.greedy(n, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5)
    if kind == 3:
        return ckpt.greedy(n, stop_token_ids=rng.sample(range(256), 20))
    return SamplingParams(max_tokens=n, temperature=0.7, seed=rng.randrange(100), logprobs=2)


def _completions(outs: list[RequestOutput]) -> list[tuple]:
    return [(c.token_ids, c.finish_reason, c.stop_reason) for c in (o.outputs[0] for o in outs)]


@pytest.mark.parametrize("trial", range(8))
def test_random_job_under_random_limits_matches_the_unconstrained_run(llama_dir, trial):
    rng = random.Random(trial)
    job = ckpt.shared_prefix_job(
        rng.randint(1, 4), rng.randint(1, 5), prefix_len=rng.choice([16, 32, 64, 80]), seed=trial
    )
    job += ckpt.random_prompts([rng.randint(1, 40) for _ in range(rng.randint(0, 4))], seed=trial)
    rng.shuffle(job)
    params = [_params(rng) for _ in job]
    block_size = rng.choice([8, 16])
    need = max(
        -(-(len(p) + sp.max_tokens) // block_size) for p, sp in zip(job, params, strict=True)
    )
    max_num_seqs = rng.randint(1, 8)
    limits = {
        "block_size": block_size,
        # Room for a group's prefix and its first wave of four requests (see test_groups for less).
        "num_gpu_blocks_override": 4 * need + 1 + rng.choice([0, 2, 30]),
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max(max_num_seqs, rng.choice([8, 16, 33, 2048])),
        "num_scheduler_steps": rng.choice([1, 4]),
        "enable_cascade_attention": rng.random() < 0.7,
    }
    llm = ckpt.engine(llama_dir, **limits)
    outs = ckpt.run(llm, job, params)
    reference = ckpt.run(ckpt.engine(llama_dir, enable_prefix_grouping=False), job, params)
    assert _completions(outs) == _completions(reference), limits
    ckpt.assert_no_leak(llm)
