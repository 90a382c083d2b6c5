"""Several decode steps per CPU round trip change nothing a request gets: tokens, seeds, stops, logprobs."""

from __future__ import annotations

import pytest
from engine_checkpoints import (
    EOS_IDS,
    assert_no_leak,
    assert_same_tokens_and_logprobs,
    engine,
    greedy,
    random_prompts,
    record_steps,
    run,
)

from prefixgrove import SamplingParams

PROMPTS = random_prompts([5 + 3 * i for i in range(12)], seed=30)
# max_tokens that end inside a 4-step window, at its edge, and after several windows
MAX_TOKENS = [5, 7, 8, 10, 13, 3, 9, 11, 6, 12, 4, 14]


def both(llama_dir: str, prompts, params, **kwargs):
    """The same job with one decode step per round trip and with windows of four and of eight; returns
    the single-step and four-step runs after checking that the eight-step run completes identically."""
    outs = []
    for steps in (1, 4, 8):
        llm = engine(llama_dir, num_scheduler_steps=steps, **kwargs)
        schedules = record_steps(llm)
        outs.append(run(llm, prompts, params))
        assert_no_leak(llm)
        if steps > 1:
            assert len(schedules) < llm.engine.metrics.steps, "no multi-step window ran"
    assert completions(outs[2]) == completions(outs[1])
    return outs[0], outs[1]


def completions(outs):
    return [
        (c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in (o.outputs[0] for o in outs)
    ]


def test_greedy_tokens_and_lengths_are_unchanged(llama_dir):
    params = [greedy(n, ignore_eos=True) for n in MAX_TOKENS]
    single, window = both(llama_dir, PROMPTS, params)
    assert completions(window) == completions(single)
    assert [len(o.outputs[0].token_ids) for o in window] == MAX_TOKENS


def test_seeded_sampling_is_unchanged(llama_dir):
    params = [
        SamplingParams(max_tokens=n, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True)
        for i, n in enumerate(MAX_TOKENS)
    ]
    single, window = both(llama_dir, PROMPTS, params)
    assert completions(window) == completions(single)


def test_eos_inside_a_window_stops_the_request_there(llama_dir):
    single, window = both(llama_dir, PROMPTS, greedy(24))
    assert any(o.outputs[0].token_ids[-1] in EOS_IDS for o in single), "needs an EOS stop"
    assert completions(window) == completions(single)


def test_stop_token_ids_and_strings_inside_a_window(llama_dir):
    free = [o.outputs[0] for o in run(engine(llama_dir), PROMPTS, greedy(16, ignore_eos=True))]
    params = []
    for i, c in enumerate(free):
        if i % 2:
            params.append(greedy(16, ignore_eos=True, stop_token_ids=[c.token_ids[6]]))
        else:
            ascii_pairs = [c.text[j : j + 2] for j in range(3, len(c.text) - 1)]
            stop = next((s for s in ascii_pairs if s.isascii() and s.isprintable()), "\n\n")
            params.append(greedy(16, ignore_eos=True, stop=[stop]))
    single, window = both(llama_dir, PROMPTS, params)
    assert completions(window) == completions(single)
    assert sum(o.outputs[0].finish_reason == "stop" for o in single) >= 8


def test_logprobs_are_unchanged(llama_dir):
    params = SamplingParams(max_tokens=9, temperature=0.8, seed=3, logprobs=3, ignore_eos=True)
    single, window = both(llama_dir, PROMPTS[:4], params)
    assert_same_tokens_and_logprobs(single, window)


def test_grouped_cascade_decode_is_unchanged(llama_dir):
    prefix = random_prompts([80], seed=40)[0]
    prompts = [prefix + s for s in random_prompts([3, 6, 9, 4, 2], seed=41)]
    params = [greedy(n, ignore_eos=True) for n in (6, 9, 4, 11, 7)]
    single, window = both(llama_dir, prompts, params)
    assert [o.num_cached_tokens for o in window] == [80] * 5
    assert completions(window) == completions(single)


def test_windows_under_block_pressure_are_unchanged(llama_dir):
    prompts = random_prompts((20, 20, 20, 20), seed=13)
    single, window = both(
        llama_dir, prompts, greedy(40, ignore_eos=True), num_gpu_blocks_override=9
    )
    assert completions(window) == completions(single)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_decode_only_batch_runs_in_windows_of_num_scheduler_steps(llama_dir, async_scheduling):
    """Equal lengths and nothing waiting: after the prefill, the 21 decode steps run as windows of 4,
    4, 4, 4, 4 and 1, each scheduled once. With async scheduling each step and window is enqueued
    behind the one before; without it, each waits for its tokens."""
    prompts = random_prompts((6, 9, 12), seed=50)
    llm = engine(llama_dir, num_scheduler_steps=4, async_scheduling=async_scheduling)
    schedules = record_steps(llm)
    outs = run(llm, prompts, greedy(22, ignore_eos=True))
    assert_no_leak(llm)
    m = llm.engine.metrics
    assert m.decode_steps == 21
    assert len([s for s in schedules if s]) == 1 + 6
    assert m.steps_launched_ahead == (7 if async_scheduling else 0)
    single = run(engine(llama_dir), prompts, greedy(22, ignore_eos=True))
    assert completions(outs) == completions(single)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_window_runs_ahead_when_waiting_work_could_join(llama_dir, async_scheduling):
    """A request ending by length inside a window frees a slot for waiting work: the next window is
    scheduled after the CPU has seen it (with async scheduling: once that window is enqueued, since
    its last token is known to be its last), so the waiting request joins at the boundary."""
    prompts = random_prompts((6, 9, 12), seed=51)
    llm = engine(
        llama_dir, num_scheduler_steps=4, max_num_seqs=2, async_scheduling=async_scheduling
    )
    schedules = record_steps(llm)
    params = [greedy(n, ignore_eos=True) for n in (5, 13, 9)]
    outs = run(llm, prompts, params)
    joined = next(i for i, s in enumerate(schedules) if any(rid.endswith("-2") for rid, *_ in s))
    # prefill of the first two; one window of 4 in which the first ends; then the third joins
    assert joined == 2, schedules[:4]
    assert_no_leak(llm)
    single = run(engine(llama_dir, max_num_seqs=2), prompts, params)
    assert completions(outs) == completions(single)


def test_abort_between_windows_gives_the_blocks_back_at_once(llama_dir):
    """Without async scheduling a window's tokens are all in before the next step: nothing on the
    device still writes an aborted request's blocks (with it, an abort first takes in the work in
    flight: tests/engine/test_async_scheduling.py)."""
    llm = engine(llama_dir, num_scheduler_steps=4, async_scheduling=False)
    eng = llm.engine
    free = eng.blocks.num_free
    for i, p in enumerate(random_prompts((7, 8, 9), seed=52)):
        eng.add_request(f"r{i}", p, greedy(30, ignore_eos=True))
    eng.step()  # the prefills
    eng.step()  # a window of four decode steps
    assert eng.metrics.decode_steps == 4
    held = eng.blocks.num_free
    eng.abort(["r0"])
    assert eng.blocks.num_free > held
    finished = []
    while eng.has_unfinished_requests():
        finished += [o.request_id for o in eng.step()]
    assert sorted(finished) == ["r1", "r2"]
    assert eng.blocks.num_free == free
