"""Structured outputs on the trained SmolLM2-135M-Instruct: every constrained output parses and validates
against its schema / matches its regex / is one of its choices, for greedy and seeded sampling, grouped
and ungrouped, one step or windows of eight per CPU round trip (the same tokens in every case); rows with
and without a constraint share a batch; a constraint that does not compile fails its request only."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest
from engine_checkpoints import SMOLLM2, assert_no_leak, chat_ids, engine, run, token_ids

from prefixgrove import LLM, RequestOutput, SamplingParams
from prefixgrove.engine.core.metrics import EngineMetrics
from prefixgrove.engine.structured import StructuredOutputsParams
from prefixgrove.engine.structured.masks import MaskStats

SYSTEM = "You extract facts from the user's note and answer with JSON only."
NOTES = [
    "Anna Berg, 34, lives in Berlin and called about a refund.",
    "Kenji Sato (age 51) from Tokyo wants to order two chairs.",
    "Marie Dupont is 27; she wrote from Paris to complain about a late parcel.",
]
# NOTE: the properties come out in this order; the jump tests' premises (where forced runs fall
# against the steps that admit waiting requests) were measured with it
SCHEMA = {
    "type": "object",
    "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Berlin", "Tokyo", "Paris", "other"]},
        "name": {"type": "string", "maxLength": 24},
        "topic": {"enum": ["refund", "order", "complaint"]},
    },
    "required": ["name", "age", "city", "topic"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any) -> list[list[int]]:
    return chat_ids(smollm2_tokenizer, [(SYSTEM, note) for note in NOTES])


def json_params() -> list[SamplingParams]:
    """Greedy, then seeded sampling, for each note."""
    schema = StructuredOutputsParams(json=SCHEMA)
    greedy = SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=schema)
    seeded = [
        SamplingParams(max_tokens=64, temperature=0.9, seed=i, structured_outputs=schema)
        for i in range(len(NOTES))
    ]
    return [greedy] * len(NOTES) + seeded


@pytest.mark.parametrize(
    "options",
    [{"num_scheduler_steps": 8}, {"num_scheduler_steps": 1, "enable_prefix_grouping": False}],
    ids=["grouped-window8", "ungrouped-step1"],
)
def test_json_schema_outputs_validate_and_match_across_windows_and_grouping(
    prompts, options, smollm2_engines, step_by_step
):
    llm = smollm2_engines(**options)
    with windows_started(llm) as windows:
        outputs = run(llm, prompts + prompts, json_params())
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    if options["num_scheduler_steps"] > 1:
        assert max(windows) > 1  # constrained rows keep their decode windows
    assert_no_leak(llm)
    reference = step_by_step(**STEP_BY_STEP).outputs[: len(outputs)]  # the jump job begins so
    assert token_ids(outputs) == token_ids(reference)


@contextmanager
def windows_started(llm: LLM) -> Iterator[list[int]]:
    """The steps of each decode window the runner starts inside the block; the runner is left as
    it was (engines are shared)."""
    runner, windows = llm.engine.runner, []
    start_window = runner.start_window
    runner.start_window = lambda batch, steps, feed=None: (  # type: ignore[method-assign]
        windows.append(steps) or start_window(batch, steps, feed)
    )
    try:
        yield windows
    finally:
        del runner.start_window


def test_regex_choice_grammar_and_json_object(prompts, smollm2_engines):
    llm = smollm2_engines(num_scheduler_steps=8)
    kinds = {
        "regex": (r"[A-Z][a-z]+ is [0-9]{1,3} years old\.", 24),
        "choice": (("refund", "order", "complaint"), 8),
        "grammar": ('root ::= "City: " ("Berlin" | "Tokyo" | "Paris") "."', 12),
        "json_object": (True, 48),
    }
    params = [
        SamplingParams(max_tokens=limit, temperature=t, seed=3,
                       structured_outputs=StructuredOutputsParams(**{kind: value}))
        for kind, (value, limit) in kinds.items()
        for t in (0.0, 1.0)
    ]  # fmt: skip
    outputs = run(llm, [prompts[0]] * len(params), params)
    texts = [o.outputs[0].text for o in outputs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs[:6]), texts
    for text in texts[0:2]:
        assert re.fullmatch(kinds["regex"][0], text), text
    for text in texts[2:4]:
        assert text in kinds["choice"][0]
    for text in texts[4:6]:
        assert re.fullmatch(r"City: (Berlin|Tokyo|Paris)\.", text), text
    for out in outputs[6:8]:  # any object may run past max_tokens: then it is a cut-off object
        text = out.outputs[0].text
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert text.startswith("{") and len(out.outputs[0].token_ids) == 48, text


def test_constrained_and_unconstrained_rows_share_a_batch(prompts, smollm2_engines):
    free = [SamplingParams(max_tokens=16, temperature=0.8, seed=i) for i in range(len(NOTES))]
    alone = run(smollm2_engines(num_scheduler_steps=8), prompts, free)
    mixed = run(smollm2_engines(num_scheduler_steps=8), prompts + prompts, free + json_params()[:3])
    assert token_ids(mixed[: len(NOTES)]) == token_ids(alone)
    for out in mixed[len(NOTES) :]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


@pytest.mark.parametrize(
    ("constraint", "problem"),
    [
        ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "/nowhere"),
        ({"json": {"type": "no-such-type"}}, "no-such-type"),
        ({"regex": "(["}, "regex"),
        ({"grammar": "root ::= missing_rule"}, "missing_rule"),
    ],
)
def test_a_constraint_that_does_not_compile_fails_its_request_only(
    prompts, constraint, problem, smollm2_engines
):
    llm = smollm2_engines()
    bad = SamplingParams(max_tokens=4, structured_outputs=constraint)
    with pytest.raises(ValueError, match=re.escape(problem)) as caught:
        llm.engine.add_request("bad", prompts[0], bad)
    assert "structured_outputs" in str(caught.value)
    assert not llm.engine.has_unfinished_requests()
    good = run(llm, prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))
    assert good[0].outputs[0].token_ids


JUMP_KINDS = {
    # a long fixed phrase, then a choice: most tokens are the only ones the grammar allows
    "regex": r"The customer is (Anna|Kenji|Marie) and the topic is (refund|order|complaint)\.",
    "grammar": 'root ::= "{\\"verdict\\": \\"" ("valid" | "invalid") "\\", \\"score\\": " [0-9] "}"',
}


def jump_params() -> list[SamplingParams]:
    """The schema's greedy and seeded rows, the fixed-phrase constraints, one constrained row with
    logprobs (never jumped) and one free row."""
    fixed = [
        SamplingParams(max_tokens=48, temperature=t, seed=5,
                       structured_outputs=StructuredOutputsParams(**{kind: value}))
        for kind, value in JUMP_KINDS.items()
        for t in (0.0, 1.0)
    ]  # fmt: skip
    with_logprobs = SamplingParams(
        max_tokens=48, temperature=1.0, seed=9, logprobs=2,
        structured_outputs=StructuredOutputsParams(regex=JUMP_KINDS["regex"]),
    )  # fmt: skip
    free = SamplingParams(max_tokens=12, temperature=0.7, seed=1)
    return json_params() + fixed + [with_logprobs, free]


def jump_job(prompts: list[list[int]]) -> list[list[int]]:
    """A prompt for each of jump_params(): the notes in turn (the JSON test's job comes first)."""
    return (prompts * 4)[: len(jump_params())]


# The plainest decoding: one step per round trip, no groups (and no jump-forward in step_by_step).
STEP_BY_STEP = {"num_scheduler_steps": 1, "enable_prefix_grouping": False}


@dataclass(frozen=True)
class SteppedRun:
    """The jump job decoded without jump-forward: its outputs, and the engine's counters after."""

    outputs: list[RequestOutput]
    metrics: EngineMetrics
    masks: MaskStats


@pytest.fixture(scope="module")
def step_by_step(prompts) -> Callable[..., SteppedRun]:
    """The jump job decoded without jump-forward under the given engine options, run once per
    module for each set of options. Every option gives the same outputs token for token (the
    JSON test checks windows and grouping), so the tests that only compare outputs compare them
    with STEP_BY_STEP's run, which several of them share."""
    runs: dict[tuple[tuple[str, Any], ...], SteppedRun] = {}

    def stepped(**options: Any) -> SteppedRun:
        key = tuple(sorted(options.items()))
        if key not in runs:
            llm = engine(SMOLLM2, structured_outputs_jump_forward=False, **options)
            outputs = run(llm, jump_job(prompts), jump_params())
            runs[key] = SteppedRun(outputs, llm.engine.metrics, llm.engine.runner.masker.stats)
        return runs[key]

    return stepped


@pytest.mark.parametrize(
    "options",
    [
        # with windows, jump-forward runs only where a step admits waiting requests (where the
        # next would compute outputs alone, windows take the forced tokens: the test below)
        {"num_scheduler_steps": 8, "max_num_seqs": 4},
        STEP_BY_STEP,
        {"num_scheduler_steps": 4, "async_scheduling": False, "max_num_seqs": 4},
    ],
    ids=["grouped-window8", "ungrouped-step1", "window4-sync"],
)
def test_jump_forward_gives_step_by_step_outputs_token_for_token(prompts, options, step_by_step):
    jumped = engine(SMOLLM2, **options)
    outputs = run(jumped, jump_job(prompts), jump_params())
    stepped = step_by_step(**options)
    reference = stepped.outputs
    assert token_ids(outputs) == token_ids(reference)
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in reference]
    assert [o.outputs[0].finish_reason for o in outputs] == [
        o.outputs[0].finish_reason for o in reference
    ]
    assert outputs[-2].outputs[0].logprobs == reference[-2].outputs[0].logprobs
    for out in outputs[: 2 * len(NOTES)]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert re.fullmatch(JUMP_KINDS["regex"], outputs[2 * len(NOTES)].outputs[0].text)
    # it did jump: forced tokens went through chunks, not decoding steps; with it off nothing jumps
    assert jumped.engine.metrics.tokens_jumped > (10 if options["num_scheduler_steps"] == 1 else 0)
    assert stepped.metrics.tokens_jumped == 0
    assert jumped.engine.metrics.decode_tokens < stepped.metrics.decode_tokens
    # the masks that ended runs served the steps sampling there (and gave the outputs above)
    assert jumped.engine.runner.masker.stats.rows_reused > 0
    assert stepped.masks.rows_reused == 0
    assert_no_leak(jumped)


def test_matchers_built_on_builder_threads_give_the_outputs_of_matchers_built_one_by_one(
    prompts, step_by_step
):
    """CUDA's builder threads, here on the CPU: a step's new rows have their matchers built on
    them; the outputs are those of matchers built one by one on the host's thread (step-by-step
    decoding's, which jump-forward gives too: the test above)."""
    import threading

    import torch

    from prefixgrove.engine.structured.masks import StepMasker

    params = jump_params()
    threaded = engine(SMOLLM2, num_scheduler_steps=8, max_num_seqs=8)
    runner = threaded.engine.runner
    runner.masker = StepMasker(torch.device("cpu"), jump_forward=True, builder_threads=2)
    grammars = threaded.engine.grammars
    matcher, built_on = grammars.matcher, []
    grammars.matcher = lambda g: built_on.append(threading.current_thread().name) or matcher(g)
    outputs = run(threaded, jump_job(prompts), params)
    assert token_ids(outputs) == token_ids(step_by_step(**STEP_BY_STEP).outputs)
    constraints = [p.structured_outputs for p in params if p.structured_outputs is not None]
    # each request's matcher once, and compile's check of each grammar
    assert len(built_on) == len(constraints) + len({c.key for c in constraints})
    assert sum(name.startswith("grammar-build") for name in built_on) > 1
    assert_no_leak(threaded)


@pytest.mark.parametrize(
    "grouping, seats",
    [(False, 256), (True, 256), (True, 3)],
    ids=["ungrouped", "grouped", "grouped-3-seats"],
)
def test_when_the_next_step_computes_outputs_alone_windows_take_the_forced_tokens(
    prompts, grouping, seats, step_by_step
):
    """With every prompt computed (a group's too) and none waiting, or every seat taken by
    requests that have sampled, decode windows (a CUDA graph per step, no round trip) take the
    forced tokens step by step instead of a chunk each: no run is forced then, and the outputs
    are step-by-step decoding's. With requests waiting and a seat free, runs are forced."""
    from prefixgrove.engine.core.sequence import SeqStatus

    job = jump_job(prompts)
    windows = engine(
        SMOLLM2, num_scheduler_steps=8, enable_prefix_grouping=grouping, max_num_seqs=seats
    )
    requests, masker = windows.engine.intake.requests, windows.engine.runner.masker
    forced_runs, seen = masker.forced_runs, []

    def recorded(*args, **kwargs):
        # whether the next step could only compute outputs: every request holding a seat (a
        # group's prefix holds one too while computed) has sampled, and none can start
        seated = [seq for seq in requests.values() if seq.status is SeqStatus.RUNNING]
        prefixes = windows.engine.scheduler.running
        waits = any(seq.status is SeqStatus.WAITING for seq in requests.values())
        seen.append(
            all(seq.num_generated > 0 for seq in seated)
            and not any(seq.is_prefix for seq in prefixes)
            and (not waits or len(prefixes) >= seats)
        )
        return forced_runs(*args, **kwargs)

    masker.forced_runs = recorded
    outputs = run(windows, job, jump_params())
    assert token_ids(outputs) == token_ids(step_by_step(**STEP_BY_STEP).outputs)
    assert not any(seen)
    assert windows.engine.metrics.decode_steps > 0
    if seats < len(job):  # requests wait: runs are forced while they start
        assert seen and windows.engine.metrics.tokens_jumped > 0
    elif not grouping:  # every prompt is computed by the first step: nothing ever jumps
        assert windows.engine.metrics.tokens_jumped == 0
    assert_no_leak(windows)


# 1 ends the regex row at its first token, a sampled one, and 2 inside the forced run after it
# (" customer is"); 5 and 9 repeat those two cuts further on (inside " and the topic is", then at
# the choice after it), so the default run leaves them out.
@pytest.mark.parametrize(
    "max_tokens",
    [1, 2, pytest.param(5, marks=pytest.mark.slow), pytest.param(9, marks=pytest.mark.slow)],
)
def test_a_forced_run_ends_where_max_tokens_or_a_stop_string_ends_it(
    prompts, max_tokens, smollm2_engines
):
    """A run cut by max_tokens, or by a stop string inside it, ends the request exactly where
    step-by-step decoding ends it."""
    constraint = StructuredOutputsParams(regex=JUMP_KINDS["regex"])
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=constraint),
        SamplingParams(max_tokens=48, temperature=0.0, stop=["topic"], structured_outputs=constraint),
        SamplingParams(max_tokens=48, temperature=0.0, stop=[" is"], include_stop_str_in_output=True,
                       structured_outputs=constraint),
    ]  # fmt: skip
    job = prompts[: len(params)]
    outputs = run(smollm2_engines(num_scheduler_steps=4), job, params)
    reference = run(
        smollm2_engines(num_scheduler_steps=4, structured_outputs_jump_forward=False), job, params
    )
    for out, ref in zip(outputs, reference, strict=True):
        a, b = out.outputs[0], ref.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert len(outputs[0].outputs[0].token_ids) == max_tokens
    assert outputs[1].outputs[0].finish_reason == "stop"
