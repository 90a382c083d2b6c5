"""The scheduler: a token budget per step, decode before prefill, a cap on running requests, and
preemption by recompute when KV blocks run out; none of it changes what a request generates."""

from __future__ import annotations

import pytest
from engine_checkpoints import (
    assert_no_leak,
    engine,
    greedy,
    random_prompts,
    record_steps,
    run,
    token_ids,
)

from prefixgrove import SamplingParams

PARAMS = greedy(6, ignore_eos=True)


def _reference(llama_dir: str, prompts: list[list[int]], params=PARAMS) -> list[list[int]]:
    """The same prompts with every limit far away."""
    llm = engine(llama_dir)
    outs = token_ids(run(llm, prompts, params))
    assert_no_leak(llm)
    return outs


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget(llama_dir: str):
    prompts = random_prompts((100, 5), seed=10)
    llm = engine(llama_dir, max_num_batched_tokens=16, max_num_seqs=4)
    steps = record_steps(llm)
    outs = run(llm, prompts, PARAMS)
    assert all(sum(n for _, n, _ in step) <= 16 for step in steps)
    long_id = outs[0].request_id
    chunks = [(n, sample) for step in steps for rid, n, sample in step if rid == long_id]
    chunks = chunks[
        : [sample for _, sample in chunks].index(True) + 1
    ]  # its prefill, up to 1st token
    assert len(chunks) >= 7, chunks
    assert sum(n for n, _ in chunks) == 100
    assert [s for _, s in chunks] == [False] * (len(chunks) - 1) + [True]
    assert token_ids(outs) == _reference(llama_dir, prompts)
    assert_no_leak(llm)


def test_decoding_requests_go_first_and_are_never_starved_by_prefill(llama_dir: str):
    prompts = random_prompts((4, 150), seed=11)
    llm = engine(llama_dir, max_num_batched_tokens=16, max_num_seqs=4)
    steps = record_steps(llm)
    outs = run(llm, prompts, greedy(8, ignore_eos=True))
    short_id, long_id = outs[0].request_id, outs[1].request_id
    short_steps = [i for i, step in enumerate(steps) if any(r == short_id for r, _, _ in step)]
    # Prefilled in the first step, then one decode token in each of the next 7 steps, back to back.
    assert short_steps == list(range(8))
    for i in short_steps[1:]:
        assert steps[i][0] == (short_id, 1, True), steps[i]
        assert any(r == long_id for r, _, _ in steps[i]), (
            "prefill should fill the rest of the budget"
        )
    assert token_ids(outs) == _reference(llama_dir, prompts, greedy(8, ignore_eos=True))
    assert_no_leak(llm)


def test_max_num_seqs_caps_the_requests_in_a_step(llama_dir: str):
    prompts = random_prompts((3, 9, 17, 5, 12, 20), seed=12)
    llm = engine(llama_dir, max_num_seqs=2)
    steps = record_steps(llm)
    running_sizes: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def watch(*args, **kwargs):
        out = schedule(*args, **kwargs)
        running_sizes.append(len(llm.engine.scheduler.running))
        return out

    llm.engine.scheduler.schedule = watch  # type: ignore[method-assign]
    outs = run(llm, prompts, PARAMS)
    assert max(len({r for r, _, _ in step}) for step in steps) == 2
    assert max(running_sizes) <= 2
    assert token_ids(outs) == _reference(llama_dir, prompts)
    assert_no_leak(llm)


def test_out_of_blocks_preempts_and_recomputes_without_changing_outputs(llama_dir: str):
    # Each request ends at 20 + 40 = 60 tokens = 4 blocks of 16; four of them need 16 of 8 usable blocks.
    prompts = random_prompts((20, 20, 20, 20), seed=13)
    params = greedy(40, ignore_eos=True)
    llm = engine(llama_dir, num_gpu_blocks_override=9)
    outs = run(llm, prompts, params)
    assert llm.engine.metrics.preemptions > 0
    assert llm.engine.scheduler.num_preemptions == llm.engine.metrics.preemptions
    assert token_ids(outs) == _reference(llama_dir, prompts, params)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_no_leak(llm)


def test_no_preemption_when_the_cache_is_large_enough(llama_dir: str):
    llm = engine(llama_dir)
    run(llm, random_prompts((20, 20, 20, 20), seed=13), greedy(40, ignore_eos=True))
    assert llm.engine.metrics.preemptions == 0
    assert_no_leak(llm)


def test_a_request_larger_than_the_whole_cache_is_refused(llama_dir: str):
    llm = engine(llama_dir, num_gpu_blocks_override=3)
    try:
        run(llm, [[1] * 30], greedy(10))
    except ValueError as e:
        assert "needs 3 KV blocks but the cache holds 2" in str(e)
    else:
        raise AssertionError("a request that can never fit must be refused")
    assert_no_leak(llm)


def test_aborted_requests_free_their_blocks(llama_dir: str):
    llm = engine(llama_dir)
    for i, prompt in enumerate(random_prompts((30, 40), seed=14)):
        llm.engine.add_request(f"r{i}", prompt, greedy(20, ignore_eos=True))
    llm.engine.step()
    assert llm.engine.blocks.num_free < llm.engine.blocks.num_usable
    llm.engine.abort(["r0", "r1"])
    assert_no_leak(llm)


def test_seeded_sampling_survives_preemption(llama_dir: str):
    prompts = random_prompts((20, 20, 20, 20), seed=13)
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True, logprobs=2)
        for i in range(4)
    ]
    tight = engine(llama_dir, num_gpu_blocks_override=9)
    outs = run(tight, prompts, params)
    assert tight.engine.metrics.preemptions > 0
    reference = run(engine(llama_dir), prompts, params)
    assert token_ids(outs) == token_ids(reference)
    for a, b in zip(outs, reference, strict=True):
        assert len(a.outputs[0].logprobs) == 40
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob)
    assert_no_leak(tight)


def test_metrics_count_prompt_and_decode_tokens(llama_dir: str):
    prompts = random_prompts((3, 17, 40), seed=15)
    llm = engine(llama_dir, max_num_batched_tokens=16, max_num_seqs=4)
    run(llm, prompts, greedy(6, ignore_eos=True))
    m = llm.engine.metrics
    assert m.prefill_tokens == 3 + 17 + 40
    assert m.decode_tokens == 3 * (6 - 1)  # the first token of each comes from its prefill
    assert m.requests_finished == 3 and m.preemptions == 0
