"""Async scheduling changes nothing a request gets: a step or a window of decode steps enqueued before
the host has seen the previous one's tokens (those reach its inputs on the device) gives the same
tokens, seeds, logprobs, stops and lengths as a run that waits for every step, and every block comes
back."""

from __future__ import annotations

import pytest
from engine_checkpoints import (
    assert_no_leak,
    assert_same_tokens_and_logprobs,
    engine,
    greedy,
    random_prompts,
    run,
    shared_prefix_job,
)

from prefixgrove import SamplingParams

# Grouped prompts and prompts of their own, and a token budget small enough that prefill chunks, joining
# members and decode rows share many steps: most steps are mixed, so most go ahead of their tokens.
JOB = shared_prefix_job(3, 5, prefix_len=48, seed=7) + random_prompts([30, 5, 17, 41], seed=8)
LENGTHS = [1, 2, 3, 5, 8, 13, 4, 9, 2, 7, 11, 6, 3, 10, 5, 12, 1, 8, 6]
SMALL_STEPS = {"max_num_batched_tokens": 48, "max_num_seqs": 12}


def both(llama_dir, prompts, params, **kwargs):
    """The job with async scheduling and without; checks that steps went ahead only in the first."""
    outs = []
    for ahead in (True, False):
        llm = engine(llama_dir, async_scheduling=ahead, **SMALL_STEPS, **kwargs)
        outs.append(run(llm, prompts, params))
        assert_no_leak(llm)
        launched = llm.engine.metrics.steps_launched_ahead
        assert (launched > 0) if ahead else (launched == 0)
    return outs


def completions(outs):
    return [
        (c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in (o.outputs[0] for o in outs)
    ]


@pytest.mark.parametrize("steps", [1, 4])  # decode steps per window
def test_greedy_tokens_lengths_and_cached_prefixes_are_unchanged(llama_dir, steps):
    params = [greedy(n, ignore_eos=True) for n in LENGTHS]
    ahead, waited = both(llama_dir, JOB, params, num_scheduler_steps=steps)
    assert completions(ahead) == completions(waited)
    assert [len(o.outputs[0].token_ids) for o in ahead] == LENGTHS
    assert [o.num_cached_tokens for o in ahead] == [o.num_cached_tokens for o in waited]
    assert sum(o.num_cached_tokens > 0 for o in ahead) >= 10, "the job's groups must share"


@pytest.mark.parametrize("steps", [1, 4])
def test_seeded_sampling_and_logprobs_are_unchanged(llama_dir, steps):
    params = [
        SamplingParams(
            max_tokens=n, temperature=0.9, top_p=0.9, seed=i, logprobs=2, ignore_eos=True
        )
        for i, n in enumerate(LENGTHS)
    ]
    ahead, waited = both(llama_dir, JOB, params, num_scheduler_steps=steps)
    assert_same_tokens_and_logprobs(waited, ahead)


def test_eos_stop_tokens_and_strings_end_requests_where_they_did(llama_dir):
    """Requests that stop at a step whose successor is already on the device: that successor's row for
    them is dropped, and nothing after the stop reaches the output."""
    free = [o.outputs[0] for o in run(engine(llama_dir), JOB, greedy(12, ignore_eos=True))]
    params = []
    for i, c in enumerate(free):
        if i % 3 == 0:
            params.append(greedy(12, ignore_eos=True, stop_token_ids=[c.token_ids[1]]))
        elif i % 3 == 1:
            ascii_pairs = [c.text[j : j + 2] for j in range(1, len(c.text) - 1)]
            stop = next((s for s in ascii_pairs if s.isascii() and s.isprintable()), "\n\n")
            params.append(greedy(12, ignore_eos=True, stop=[stop]))
        else:
            params.append(greedy(12))  # EOS may end it
    for steps in (1, 4):
        ahead, waited = both(llama_dir, JOB, params, num_scheduler_steps=steps)
        assert completions(ahead) == completions(waited)
    assert sum(o.outputs[0].finish_reason == "stop" for o in ahead) >= 6


def test_penalties_keep_every_step_waiting_for_its_tokens(llama_dir):
    """Penalties read every output token on the host, so a batch holding such a request never goes
    ahead (here every batch: no groups, whose prefix-only steps could)."""
    prompts = random_prompts([30, 5, 17, 41, 26, 9, 33], seed=11)
    params = greedy(6, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4)
    llm = engine(llama_dir, **SMALL_STEPS)
    with_penalties = run(llm, prompts, params)
    assert llm.engine.metrics.steps_launched_ahead == 0
    assert_no_leak(llm)
    waited = run(engine(llama_dir, async_scheduling=False, **SMALL_STEPS), prompts, params)
    assert completions(with_penalties) == completions(waited)


def test_abort_while_a_step_is_in_flight(llama_dir):
    """Aborting takes the step in flight's tokens in first; the others' requests finish as they would."""
    prompts = random_prompts([20, 33, 12], seed=9)
    llm = engine(llama_dir, **SMALL_STEPS)
    for i, p in enumerate(prompts):
        llm.engine.add_request(str(i), p, greedy(5, ignore_eos=True))
    llm.engine.step()
    llm.engine.step()
    assert llm.engine.metrics.steps_launched_ahead == 2
    llm.engine.abort(["1"])
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += llm.engine.step()
    assert_no_leak(llm)
    assert sorted(o.request_id for o in outs) == ["0", "2"]
    alone = run(engine(llama_dir, async_scheduling=False), [prompts[0], prompts[2]], greedy(5))
    by_id = {o.request_id: o.outputs[0].token_ids for o in outs}
    assert [by_id["0"], by_id["2"]] == [o.outputs[0].token_ids for o in alone]


def test_requests_awaiting_their_last_token_are_not_scheduled_again(llama_dir):
    """A request whose max_tokens-th token is on its way gets no row in the next step."""
    llm = engine(llama_dir, **SMALL_STEPS)
    for i, p in enumerate(random_prompts([9, 14, 40], seed=10)):
        llm.engine.add_request(str(i), p, greedy(1 if i < 2 else 4, ignore_eos=True))
    scheduled = []
    schedule = llm.engine.scheduler.schedule

    def recording() -> object:
        out = schedule()
        scheduled.append({item.seq.request_id for item in out.batch})
        return out

    llm.engine.scheduler.schedule = recording  # type: ignore[method-assign]
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += llm.engine.step()
    assert_no_leak(llm)
    assert {o.request_id: len(o.outputs[0].token_ids) for o in outs} == {"0": 1, "1": 1, "2": 4}
    first = next(i for i, ids in enumerate(scheduled) if "0" in ids)
    assert all("0" not in ids for ids in scheduled[first + 1 :])
