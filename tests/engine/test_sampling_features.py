"""vLLM's SamplingParams features beyond plain sampling: params changed after construction,
max_tokens=None, min_tokens, logit_bias, allowed_token_ids, bad_words; and rows without them get
exactly what they get alone."""

from __future__ import annotations

import pytest
import torch
from engine_checkpoints import EOS_IDS, engine, greedy, random_prompts, record_steps, run, token_ids

from prefixgrove import LLM, RequestOutput, SamplingParams
from prefixgrove.engine.core.sequence import Sequence
from prefixgrove.engine.sampling.sampler import SamplingBatch
from prefixgrove.grouping import PrefixGroup

X, Y = ord("x"), ord("y")
FORCE_X = {X: 100.0}  # greedy then always picks "x"
PROMPTS = random_prompts([5, 9, 14, 7], seed=11)


@pytest.fixture(scope="module")
def llm(llama_dir: str) -> LLM:
    return engine(llama_dir, max_model_len=64)


def one(llm: LLM, params: SamplingParams, prompt: list[int] | None = None):
    return run(llm, [prompt or PROMPTS[0]], params)[0].outputs[0]


def drain(llm: LLM) -> list[RequestOutput]:
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += llm.engine.step()
    return outs


def test_a_field_changed_after_construction_is_used(llm: LLM):
    params = SamplingParams(max_tokens=4, temperature=0.0)
    params.max_tokens = 5
    assert len(one(llm, params).token_ids) == 5


def test_a_field_changed_to_an_invalid_value_is_refused_when_the_engine_takes_it(llm: LLM):
    params = greedy(4)
    params.temperature = -1.0
    with pytest.raises(ValueError, match=r"prompt 0: SamplingParams.temperature=-1.0"):
        one(llm, params)
    with pytest.raises(ValueError, match=r"request 'r': SamplingParams.temperature=-1.0"):
        llm.engine.add_request("r", [1, 2, 3], params)
    assert not llm.engine.has_unfinished_requests()


def test_a_change_after_generate_does_not_reach_the_engines_copy(llm: LLM):
    params = greedy(3)
    llm.engine.add_request("copy", [1, 2, 3], params)
    params.max_tokens = 9
    outs = drain(llm)
    assert len(outs[0].outputs[0].token_ids) == 3


def test_params_of_ids_validated_elsewhere_are_still_prepared(llm: LLM):
    params = greedy(8, logit_bias={EOS_IDS[0]: 100.0}, min_tokens=4)
    ids = llm.engine.validate([1, 2, 3], params)
    llm.engine.add_request("checked", ids, params, validated=True)
    outs = drain(llm)
    assert len(outs[0].outputs[0].token_ids) == 5


def test_max_tokens_none_runs_to_the_context_limit(llm: LLM):
    out = one(llm, greedy(None, ignore_eos=True), prompt=list(range(1, 11)))
    assert len(out.token_ids) == 64 - 10 and out.finish_reason == "length"


def test_max_tokens_none_refuses_a_prompt_that_fills_the_context(llm: LLM):
    with pytest.raises(ValueError, match=r"prompt of 64 tokens leaves no room for output"):
        one(llm, greedy(None), prompt=[5] * 64)


def test_logit_bias_is_added_to_the_logits(llm: LLM):
    assert one(llm, greedy(6, logit_bias=FORCE_X)).token_ids == [X] * 6


def test_eos_cannot_end_a_request_before_min_tokens(llm: LLM):
    force_eos = {EOS_IDS[0]: 100.0}
    assert one(llm, greedy(8, logit_bias=force_eos)).token_ids == [EOS_IDS[0]]
    out = one(llm, greedy(8, logit_bias=force_eos, min_tokens=4))
    assert EOS_IDS[0] not in out.token_ids[:4] and out.token_ids[4] == EOS_IDS[0]
    assert out.finish_reason == "stop"


def test_stop_token_ids_cannot_end_a_request_before_min_tokens(llm: LLM):
    out = one(llm, greedy(8, logit_bias=FORCE_X, stop_token_ids=[X], min_tokens=3))
    assert out.token_ids[3] == X and X not in out.token_ids[:3]
    assert (out.finish_reason, out.stop_reason) == ("stop", X)


def test_stop_strings_cannot_end_a_request_before_min_tokens(llm: LLM):
    assert one(llm, greedy(8, logit_bias=FORCE_X, stop=["x"])).token_ids == [X]
    out = one(llm, greedy(8, logit_bias=FORCE_X, stop=["x"], min_tokens=3))
    assert out.token_ids == [X] * 3 and out.text == "xx" and out.finish_reason == "stop"


def test_only_allowed_token_ids_are_sampled(llm: LLM):
    allowed = [65, 66, 67]
    out = one(llm, SamplingParams(max_tokens=12, seed=3, allowed_token_ids=allowed))
    assert set(out.token_ids) <= set(allowed)


def test_a_bad_word_of_one_token_is_never_produced(llm: LLM):
    out = one(llm, greedy(6, logit_bias=FORCE_X, bad_words=["x"]))
    assert X not in out.token_ids and len(out.token_ids) == 6


def test_a_bad_word_of_several_tokens_is_banned_after_its_first_tokens(llm: LLM):
    params = greedy(6, logit_bias={X: 100.0, Y: 99.0}, bad_words=["xx"])
    assert one(llm, params).text == "xyxyxy"


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match=r"stop=\('end',\) needs detokenize=True"):
        SamplingParams(stop="end", detokenize=False)


def test_a_token_id_outside_the_vocabulary_is_refused(llm: LLM):
    with pytest.raises(ValueError, match=r"prompt 0: SamplingParams.allowed_token_ids .* 9999"):
        one(llm, greedy(2, allowed_token_ids=[1, 9999]))


def test_a_batch_without_these_features_builds_no_logit_changes():
    seqs = [Sequence(i, f"r{i}", [1, 2], greedy(4), 0) for i in range(3)]
    batch = SamplingBatch.build(seqs, torch.device("cpu"), 300, steps=4)
    assert batch.adjust is None


FEATURES = [
    dict(min_tokens=6, logit_bias={EOS_IDS[0]: 5.0}),
    dict(logit_bias=FORCE_X, bad_words=["xx"]),
    dict(allowed_token_ids=[65, 66, 67]),
    dict(n=3, truncate_prompt_tokens=4),
]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
@pytest.mark.parametrize("steps", [1, 4])
def test_rows_without_the_features_get_their_own_tokens_in_a_mixed_batch(
    llama_dir: str, temperature: float, steps: int
):
    llm = engine(llama_dir, num_scheduler_steps=steps)
    plain = [SamplingParams(max_tokens=10, temperature=temperature, seed=i) for i in range(4)]
    alone = token_ids(run(llm, PROMPTS, plain))
    featured = [
        SamplingParams(max_tokens=10, temperature=temperature, seed=9, **kw) for kw in FEATURES
    ]
    mixed = run(llm, PROMPTS + PROMPTS[: len(FEATURES)], plain + featured)
    assert token_ids(mixed[:4]) == alone


# Fixed per request (no earlier output read): these run in windows of several steps.
STATIC_FEATURES = [
    dict(min_tokens=2, logit_bias={EOS_IDS[0]: 3.0}),
    dict(logit_bias={X: 2.0}, bad_words=["y"]),
    dict(allowed_token_ids=[65, 66, 67]),
]


@pytest.mark.parametrize("features", [FEATURES, STATIC_FEATURES], ids=["per-step", "static"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_features_give_the_same_tokens_in_windows_and_ahead(
    llama_dir: str, features: list[dict], async_scheduling: bool
):
    params = [SamplingParams(max_tokens=10, seed=9, **kw) for kw in features]
    prompts = PROMPTS[: len(features)]
    single = token_ids(run(engine(llama_dir), prompts, params))
    llm = engine(llama_dir, num_scheduler_steps=4, async_scheduling=async_scheduling)
    schedules = record_steps(llm)
    assert token_ids(run(llm, prompts, params)) == single
    windows = len(schedules) < llm.engine.metrics.steps
    assert windows == (features is STATIC_FEATURES)


def test_n_samples_come_back_in_one_request_output_indexed_in_order(llm: LLM):
    out = run(llm, [PROMPTS[0]], SamplingParams(n=3, max_tokens=5, seed=5))
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    assert out[0].prompt_token_ids == PROMPTS[0]


def test_seeded_sample_j_is_the_request_with_seed_plus_j(llm: LLM):
    samples = run(llm, [PROMPTS[1]], SamplingParams(n=3, max_tokens=8, seed=5))[0].outputs
    alone = [one(llm, SamplingParams(max_tokens=8, seed=5 + j), PROMPTS[1]) for j in range(3)]
    assert [c.token_ids for c in samples] == [c.token_ids for c in alone]
    assert len({tuple(c.token_ids) for c in samples}) == 3


def test_greedy_samples_are_identical(llm: LLM):
    samples = run(llm, [PROMPTS[2]], greedy(6, n=4))[0].outputs
    assert len(samples) == 4 and all(c.token_ids == samples[0].token_ids for c in samples)


@pytest.mark.parametrize("groups", [None, []], ids=["grouped-here", "groups-given"])
def test_the_samples_of_a_prompt_share_its_prompt_kv(llama_dir: str, groups: list | None):
    llm = engine(llama_dir)
    prompt = random_prompts([40], seed=4)[0]
    llm.generate([{"prompt_token_ids": prompt}], greedy(3, n=3), use_tqdm=False, groups=groups)
    assert llm.engine.metrics.prefix_tokens_reused == 3 * 32  # two whole blocks of 16, each sample


def test_best_of_more_than_n_is_refused():
    with pytest.raises(ValueError, match=r"best_of=3 is invalid: expected None or n=2"):
        SamplingParams(n=2, best_of=3)


def test_the_engine_answers_n_samples_added_to_it_as_generate_does(llm: LLM):
    """The worker's and the local run's path: requests of n > 1 added to the engine itself, alone
    and in a group beside a request of one sample, come back once each, equal to generate's."""
    seeded = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=21)
    want = [run(llm, [p], seeded)[0] for p in PROMPTS[:2]]
    prefix = PROMPTS[0][:4]
    engine_ = llm.engine
    engine_.add_request("alone", PROMPTS[0], seeded)
    members = [("g0", PROMPTS[1], seeded), ("g1", prefix + PROMPTS[2], greedy(4))]
    engine_.add_group("grp", PrefixGroup(4, (0, 1)), members)
    outs = {out.request_id: out for out in drain(llm)}
    assert sorted(outs) == ["alone", "g0", "g1"]
    for rid, expected in (("alone", want[0]), ("g0", want[1])):
        got = outs[rid].outputs
        assert [c.index for c in got] == [0, 1, 2]
        assert [c.token_ids for c in got] == [c.token_ids for c in expected.outputs]
    assert outs["g1"].outputs[0].token_ids == one(llm, greedy(4), prefix + PROMPTS[2]).token_ids


def test_aborting_a_request_of_n_samples_aborts_them_all(llm: LLM):
    llm.engine.add_request("many", PROMPTS[3], greedy(20, n=4))
    llm.engine.step()
    llm.engine.abort(["many"])
    assert drain(llm) == []
    assert not llm.engine.has_unfinished_requests()
    llm.engine.add_request("many", PROMPTS[3], greedy(2, n=2))  # its id is free again
    assert [len(c.token_ids) for c in drain(llm)[0].outputs] == [2, 2]


def test_a_group_with_a_refused_request_of_n_samples_queues_nothing(llm: LLM):
    members = [("ok", PROMPTS[0], greedy(2, n=2)), ("bad", [10**9], greedy(2, n=2))]
    with pytest.raises(ValueError, match=r"request 'bad' of group 'refused'"):
        llm.engine.add_group("refused", PrefixGroup(4, (0, 1)), members)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.add_request("ok", PROMPTS[0], greedy(2, n=2))  # nothing of it was left behind
    assert len(drain(llm)[0].outputs) == 2


def test_truncate_prompt_tokens_keeps_the_last_k_prompt_tokens(llm: LLM):
    prompt = random_prompts([20], seed=8)[0]
    out = run(llm, [prompt], greedy(5, truncate_prompt_tokens=6))[0]
    assert out.prompt_token_ids == prompt[-6:]
    assert out.outputs[0].token_ids == one(llm, greedy(5), prompt[-6:]).token_ids
