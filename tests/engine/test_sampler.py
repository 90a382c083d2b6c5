"""The sampler: seeded draws that ignore the rest of the batch, filters that reduce to greedy at their
limits, penalties that push the documented way, and logprobs of the raw distribution."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from engine_checkpoints import build_model, engine, greedy, random_prompts, run, token_ids

from prefixgrove import LLM, SamplingParams

PROMPTS = random_prompts((6, 20, 40), seed=20)


@pytest.fixture(scope="module")
def llm(llama_dir: str) -> LLM:
    return engine(llama_dir)


def sampled(seed: int | None = 7, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 16)
    return SamplingParams(temperature=1.0, seed=seed, ignore_eos=True, **kwargs)


def one(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    return run(llm, [prompt], params)[0].outputs[0].token_ids


def test_seeded_sampling_is_reproducible(llm):
    assert one(llm, PROMPTS[0], sampled()) == one(llm, PROMPTS[0], sampled())


def test_seeded_sampling_ignores_the_rest_of_the_batch_and_its_order(llm):
    alone = one(llm, PROMPTS[1], sampled(seed=11))
    others = [
        (PROMPTS[0], sampled(seed=None)),
        (PROMPTS[2], greedy(16, ignore_eos=True)),
        (PROMPTS[0], sampled(seed=3, top_k=5, top_p=0.9)),
    ]
    for batch in (others[:1], others, others[::-1]):
        for at in (0, len(batch)):
            items = [*batch[:at], (PROMPTS[1], sampled(seed=11)), *batch[at:]]
            outs = run(llm, [p for p, _ in items], [sp for _, sp in items])
            assert outs[at].outputs[0].token_ids == alone, f"{len(batch)} others, at {at}"


def test_same_seed_on_two_requests_draws_the_same_tokens(llm):
    outs = run(llm, [PROMPTS[2], PROMPTS[2]], sampled(seed=5))
    assert token_ids(outs)[0] == token_ids(outs)[1]


def test_largest_seed_is_usable_and_reproducible(llm):
    params = sampled(seed=2**63 - 1)
    assert one(llm, PROMPTS[0], params) == one(llm, PROMPTS[0], params)


def test_unseeded_requests_follow_the_engine_seed(llama_dir):
    params = sampled(seed=None)
    first = token_ids(run(engine(llama_dir, seed=5), PROMPTS, params))
    assert token_ids(run(engine(llama_dir, seed=5), PROMPTS, params)) == first
    assert token_ids(run(engine(llama_dir, seed=6), PROMPTS, params)) != first


def test_disabled_filters_change_nothing(llm):
    plain = one(llm, PROMPTS[2], sampled(seed=8))
    assert one(llm, PROMPTS[2], sampled(seed=8, top_k=-1, top_p=1.0, min_p=0.0)) == plain
    assert one(llm, PROMPTS[2], sampled(seed=8, top_k=10_000)) == plain


def test_different_seeds_draw_different_tokens(llm):
    assert one(llm, PROMPTS[0], sampled(seed=1)) != one(llm, PROMPTS[0], sampled(seed=2))


def test_sampling_at_temperature_one_is_not_greedy(llm):
    assert one(llm, PROMPTS[0], sampled(seed=1)) != one(
        llm, PROMPTS[0], greedy(16, ignore_eos=True)
    )


@pytest.mark.parametrize(
    "filters",
    [
        {"top_k": 1},
        {"top_p": 1e-6},
        {"min_p": 1.0},
        {"temperature": 0.0},
        {"temperature": 1e-4},
    ],
    ids=["top_k=1", "top_p=1e-6", "min_p=1", "temperature=0", "temperature=1e-4"],
)
def test_filters_at_their_limit_equal_greedy(llm, filters):
    base = {"temperature": 1.3, "seed": 4, "ignore_eos": True, "max_tokens": 16}
    params = SamplingParams(**{**base, **filters})
    for prompt in PROMPTS:
        assert one(llm, prompt, params) == one(llm, prompt, greedy(16, ignore_eos=True))


def test_temperature_sampling_follows_the_model_distribution(llm):
    """1,000 seeded one-token draws: each of the top tokens' frequency is within 4.5 sigma of its
    probability (the engine's logprobs match transformers, test_hf_parity)."""
    prompt = PROMPTS[1]
    n = 1000
    top = run(llm, [prompt], greedy(1, logprobs=10))[0].outputs[0].logprobs[0]
    outs = run(llm, [prompt] * n, [sampled(seed=s, max_tokens=1) for s in range(n)])
    counts = Counter(o.outputs[0].token_ids[0] for o in outs)
    for tid, lp in top.items():
        p = math.exp(lp.logprob)
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(counts[tid] - n * p) <= 4.5 * sigma + 1, (tid, counts[tid], n * p)


def test_top_k_draws_only_among_the_k_most_likely(llm):
    prompt = PROMPTS[1]
    top = run(llm, [prompt], greedy(1, logprobs=3))[0].outputs[0].logprobs[0]
    top3 = {tid for tid, lp in top.items() if lp.rank is not None and lp.rank <= 3}
    outs = run(llm, [prompt] * 200, [sampled(seed=s, max_tokens=1, top_k=3) for s in range(200)])
    drawn = {o.outputs[0].token_ids[0] for o in outs}
    assert drawn <= top3 and len(drawn) > 1


def _distinct(tokens: list[int]) -> int:
    return len(set(tokens))


def test_large_repetition_penalty_avoids_prompt_and_repeated_tokens(llm):
    baseline = token_ids(run(llm, PROMPTS, greedy(24, ignore_eos=True)))
    assert any(_distinct(t) < 24 for t in baseline), "the test needs a baseline that repeats"
    penalized = token_ids(run(llm, PROMPTS, greedy(24, ignore_eos=True, repetition_penalty=10.0)))
    for prompt, tokens in zip(PROMPTS, penalized, strict=True):
        assert _distinct(tokens) == 24
        assert not set(tokens) & set(prompt)


def test_repetition_penalty_below_one_favours_prompt_tokens(llm):
    def overlap(outs: list[list[int]]) -> int:
        return sum(len(set(t) & set(p)) for t, p in zip(outs, PROMPTS, strict=True))

    baseline = token_ids(run(llm, PROMPTS, greedy(24, ignore_eos=True)))
    favoured = token_ids(run(llm, PROMPTS, greedy(24, ignore_eos=True, repetition_penalty=0.1)))
    assert overlap(favoured) > overlap(baseline)


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_positive_presence_and_frequency_penalties_prevent_repeats(llm, field):
    outs = token_ids(run(llm, PROMPTS, greedy(24, ignore_eos=True, **{field: 2.0})))
    assert all(_distinct(t) == 24 for t in outs)


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_negative_presence_and_frequency_penalties_encourage_repeats(llm, field):
    baseline = token_ids(run(llm, PROMPTS, greedy(24, ignore_eos=True)))
    outs = token_ids(run(llm, PROMPTS, greedy(24, ignore_eos=True, **{field: -2.0})))
    for more, base in zip(outs, baseline, strict=True):
        assert _distinct(more) < _distinct(base)


def test_logprobs_are_of_the_raw_distribution_with_sorted_top_n(llama_dir, llm):
    """Sampled with temperature and a penalty: the reported logprobs still come from the raw logits."""
    model = build_model("llama3")
    params = SamplingParams(
        max_tokens=8, temperature=0.7, seed=9, repetition_penalty=1.5, logprobs=4, ignore_eos=True
    )
    prompt = PROMPTS[2]
    completion = run(llm, [prompt], params)[0].outputs[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion.token_ids])).logits[0]
    expected = logits[len(prompt) - 1 : -1].log_softmax(-1)
    assert completion.logprobs is not None and len(completion.logprobs) == 8
    cumulative = 0.0
    for step, (token, entry) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        chosen = entry[token]
        assert chosen.logprob == pytest.approx(expected[step, token].item(), abs=1e-4)
        assert chosen.rank == int((expected[step] > expected[step, token]).sum()) + 1
        cumulative += chosen.logprob
        top = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank <= 4)
        assert [r[0] for r in top] == [1, 2, 3, 4]
        assert [r[2] for r in top] == sorted((r[2] for r in top), reverse=True)
        assert len(entry) == (4 if chosen.rank <= 4 else 5)
    assert completion.cumulative_logprob == pytest.approx(cumulative, abs=1e-4)


def test_logprobs_zero_returns_only_the_chosen_token(llm):
    completion = run(llm, [PROMPTS[0]], greedy(3, ignore_eos=True, logprobs=0))[0].outputs[0]
    assert completion.logprobs is not None
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert list(entry) == [token] and entry[token].rank == 1  # greedy: the most likely


def test_no_logprobs_unless_asked(llm):
    completion = run(llm, [PROMPTS[0]], greedy(3))[0].outputs[0]
    assert completion.logprobs is None and completion.cumulative_logprob is None


def test_top_k_beyond_the_vocabulary_samples_as_if_it_were_off(llm):
    """top_k up to int32's limit is valid: the sampler holds it as the vocabulary size."""
    off = one(llm, PROMPTS[0], sampled(seed=5))
    assert one(llm, PROMPTS[0], sampled(seed=5, top_k=2**31 - 1, top_p=0.99)) == one(
        llm, PROMPTS[0], sampled(seed=5, top_k=0, top_p=0.99)
    )
    assert one(llm, PROMPTS[0], sampled(seed=5, top_k=2**31 - 1)) == off


def test_the_top_noise_draw_stays_below_one_so_a_masked_token_never_wins() -> None:
    from prefixgrove.engine.sampling.sampler import Sampler, SamplingBatch, hash32, uniform

    # (2**24 - 0.5) / 2**24 rounds to 1.0 in fp32: -log(1) = 0 made p / 0 = inf (or NaN for p = 0)
    top = torch.tensor([0xFFFFFFFF, 0xFFFFFF00, 0], dtype=torch.int64)
    u = uniform(top)
    assert bool((u < 1).all()) and bool((u > 0).all())
    # a (key, token) whose draw is the top one: the token is masked off and must not be sampled
    vocab = 64
    sampler = Sampler(vocab, torch.device("cpu"))
    token = 5
    key = 13708878  # the first key from 0 on that draws the top value for the token
    assert int(hash32(torch.tensor(key) ^ sampler._vocab_keys[token])) >> 8 == 0xFFFFFF
    logits = torch.zeros(1, vocab)
    logits[0, token] = float("-inf")
    batch = SamplingBatch(
        temperature=torch.ones(1), top_k=torch.zeros(1, dtype=torch.int64), top_p=torch.ones(1),
        min_p=torch.zeros(1), keys=torch.tensor([[key]]), all_greedy=False, need_sort=False,
        need_min_p=False, num_logprobs=-1, penalties=None,
    )  # fmt: skip
    assert int(sampler(logits, batch)[0, 0]) != token
