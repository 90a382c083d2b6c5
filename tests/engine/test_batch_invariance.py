"""On the CPU a request's tokens and logprobs are the same bytes whatever else shares its steps: alone,
beside a few requests or many, in prefill chunks cut anywhere, in decode steps that shrink as others
finish, grouped with others of its prefix or not. The planner's workers batch a job differently from
`prefixgrove run`, and both must write the same lines."""

from __future__ import annotations

import pytest
from engine_checkpoints import engine, greedy, random_prompts

from prefixgrove import SamplingParams
from prefixgrove.engine import RequestOutput
from prefixgrove.grouping import PrefixGroup

LOGPROBS = 5
PREFIX_LEN = 80  # above the cascade's 64-token threshold: the group's prefix is attended apart
TARGET = greedy(8, ignore_eos=True, logprobs=LOGPROBS)
SAMPLED_TARGET = SamplingParams(
    max_tokens=8, temperature=0.9, seed=11, ignore_eos=True, logprobs=LOGPROBS
)


def fingerprint(out: RequestOutput) -> list[tuple[int, list[tuple[int, float, int | None]]]]:
    """Each generated token with its logprob entries (id, exact float, rank), in a comparable form."""
    completion = out.outputs[0]
    assert completion.logprobs is not None
    return [
        (token, sorted((tid, lp.logprob, lp.rank) for tid, lp in entry.items()))
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)
    ]


def others(count: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """`count` unrelated requests of mixed prompt lengths and output lengths (they finish at
    different steps, so the decode batches around the target shrink step by step)."""
    prompts = random_prompts([7 + (i * 37) % 150 for i in range(count)], seed=seed)
    params = [
        greedy(1 + i % 11, ignore_eos=True, logprobs=i % (LOGPROBS + 1)) for i in range(count)
    ]
    return prompts, params


BATCHES = [
    pytest.param(0, 512, 16, id="alone"),
    pytest.param(3, 512, 16, id="beside-3"),
    pytest.param(12, 512, 16, id="beside-12"),
    pytest.param(12, 48, 16, id="beside-12-prefill-in-chunks-of-48"),
    pytest.param(30, 100, 6, id="beside-30-six-at-a-time"),
]


@pytest.fixture(scope="module")
def target_prompt() -> list[int]:
    return random_prompts([61], seed=99)[0]


def run_target(
    llama_dir: str, prompt: list[int], params: SamplingParams, count: int, budget: int, seqs: int
) -> RequestOutput:
    """The target request, first in the job, beside `count` others, under a step budget."""
    prompts, other_params = others(count, seed=count + budget)
    llm = engine(
        llama_dir,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        enable_prefix_grouping=False,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in [prompt, *prompts]],
        [params, *other_params],
        use_tqdm=False,
    )
    return outs[0]


@pytest.mark.parametrize(("count", "budget", "seqs"), BATCHES)
@pytest.mark.parametrize("params", [TARGET, SAMPLED_TARGET], ids=["greedy", "seeded"])
def test_an_ungrouped_request_gets_the_same_bytes_in_any_batch(
    llama_dir, target_prompt, params, count, budget, seqs
):
    alone = run_target(llama_dir, target_prompt, params, 0, 512, 16)
    got = run_target(llama_dir, target_prompt, params, count, budget, seqs)
    assert fingerprint(got) == fingerprint(alone)


def grouped_job(mates: int, seed: int) -> tuple[list[list[int]], list[PrefixGroup]]:
    """The target first, `mates` requests sharing its 80-token prefix after it, as one group."""
    prefix, *suffixes = random_prompts([PREFIX_LEN] + [3 + 5 * i for i in range(mates + 1)], seed)
    prompts = [prefix + suffix for suffix in suffixes]
    return prompts, [PrefixGroup(PREFIX_LEN, tuple(range(len(prompts))))]


def run_grouped_target(
    llama_dir: str, mates: int, count: int, budget: int, seqs: int
) -> RequestOutput:
    """The target in its group of `mates` + 1, beside `count` ungrouped requests."""
    group_prompts, groups = grouped_job(mates, seed=7)
    # The group's mates stop at different lengths: some decode steps hold the target without them.
    mate_params = [greedy(2 + 3 * i, ignore_eos=True, logprobs=1) for i in range(mates)]
    prompts, other_params = others(count, seed=count + budget + 1)
    llm = engine(llama_dir, max_num_batched_tokens=budget, max_num_seqs=seqs)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in [*group_prompts, *prompts]],
        [TARGET, *mate_params, *other_params],
        use_tqdm=False,
        groups=groups,
    )
    assert outs[0].num_cached_tokens == PREFIX_LEN  # the prefix really was shared
    return outs[0]


@pytest.mark.parametrize(("count", "budget", "seqs"), BATCHES)
def test_a_grouped_request_gets_the_same_bytes_in_any_batch(llama_dir, count, budget, seqs):
    alone = run_grouped_target(llama_dir, 1, 0, 512, 16)
    got = run_grouped_target(llama_dir, 3, count, budget, seqs)
    assert fingerprint(got) == fingerprint(alone)
