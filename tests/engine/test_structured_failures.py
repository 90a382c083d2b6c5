"""Structured outputs are enforced or the request fails, never silently dropped: a matcher that fails
mid-decode ends its request with finish_reason "error" and llguidance's reason (one step, decode
windows, jump-forward; its KV blocks go back, and the rest of the batch gets its answers), an output
is checked against its grammar once more at its end, and a constraint no output can meet is refused
as its request comes in."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
from engine_checkpoints import SMOLLM2, assert_no_leak, chat_ids, engine, run, token_ids

from prefixgrove import SamplingParams
from prefixgrove.engine.structured import StructuredOutputsParams

# A prefix of tokens each forced alone, a choice the model makes, a forced `",`, then a rule of 3,000
# alternatives: consuming the `",` makes llguidance's parser row hold 3,001 items (its limit is
# 2,000), and the matcher fails there, mid-decode. A real failure of llguidance, not a fault made up.
PREFIX = '{"verdict": "'
WIDE_RULE = (
    'start: "{\\"verdict\\": \\"" ("valid" | "invalid") "\\", \\"score\\": " score\n'
    "score: " + " | ".join(f'"s{i}"' for i in range(3000))
)
WIDE_ERROR = "Current row has 3001 items"


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any) -> list[list[int]]:
    notes = ["The parcel came late.", "Great service, thanks!", "Refund me now.", "All good."]
    return chat_ids(smollm2_tokenizer, [("Judge the note; answer in JSON.", n) for n in notes])


def failing(seed: int | None = None) -> SamplingParams:
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(max_tokens=32, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputsParams(grammar=WIDE_RULE))  # fmt: skip


def others() -> list[SamplingParams]:
    """A constrained request that holds, and a free one."""
    regex = StructuredOutputsParams(regex=r"The note is (late|kind|angry|fine)\.")
    return [
        SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=regex),
        SamplingParams(max_tokens=12, temperature=0.8, seed=1),
    ]


@pytest.mark.parametrize(
    "options",
    [
        {"num_scheduler_steps": 1, "structured_outputs_jump_forward": False},
        {"num_scheduler_steps": 8, "structured_outputs_jump_forward": False},
        {"num_scheduler_steps": 1},
        {"num_scheduler_steps": 8, "max_num_seqs": 2},
        {"num_scheduler_steps": 8, "async_scheduling": False},
    ],
    ids=["step1", "window8", "jump-forward", "window8-jump-forward", "window8-sync"],
)
def test_a_matcher_that_fails_mid_decode_ends_its_request_as_an_error(
    prompts, options, smollm2_engines
):
    """The failing requests end with finish_reason "error" and the matcher's reason, keeping only
    tokens sampled under their constraint (a window's later tokens for them are dropped); the
    requests beside them get what they get without them."""
    llm = engine(SMOLLM2, **options)
    masker = llm.engine.runner.masker
    forced_runs, failed_in_runs = masker.forced_runs, []

    def recorded(starts):
        runs = forced_runs(starts)
        failed_in_runs.extend(state.error for state, _ in starts if state.error is not None)
        return runs

    masker.forced_runs = recorded
    outputs = run(llm, prompts, [others()[0], failing(), others()[1], failing(seed=4)])
    for out in (outputs[1], outputs[3]):
        completion = out.outputs[0]
        assert completion.finish_reason == "error", completion.text
        assert completion.error is not None and WIDE_ERROR in completion.error
        assert completion.error.startswith("structured_outputs.grammar could not be enforced")
        # what came before the failure, every token of it under the constraint
        assert any(
            f'{PREFIX}{choice}", "score": '.startswith(completion.text)
            for choice in ("valid", "invalid")
        ), completion.text
    alone = run(smollm2_engines(**options), prompts[::2], others())
    assert token_ids([outputs[0], outputs[2]]) == token_ids(alone)
    assert [o.outputs[0].finish_reason for o in (outputs[0], outputs[2])] == [
        o.outputs[0].finish_reason for o in alone
    ]
    assert_no_leak(llm)
    if options.get("structured_outputs_jump_forward", True) and options["num_scheduler_steps"] == 1:
        assert failed_in_runs  # the forced `",` failed the matcher inside a jump-forward run


def test_a_request_whose_constraint_failed_frees_its_blocks_at_once(prompts):
    """It leaves the engine as soon as the step that found the failure is taken in, while the
    request beside it goes on decoding."""
    llm = engine(SMOLLM2, num_scheduler_steps=1, structured_outputs_jump_forward=False)
    core = llm.engine
    core.add_request("fails", prompts[0], failing())
    core.add_request("long", prompts[1], SamplingParams(max_tokens=48, temperature=0.0,
                                                        ignore_eos=True))  # fmt: skip
    finished: dict[str, int] = {}
    steps = 0
    while core.has_unfinished_requests():
        steps += 1
        for out in core.step():
            finished[out.request_id] = steps
            if out.request_id == "fails":
                assert out.outputs[0].finish_reason == "error"
                assert "fails" not in core.intake.requests
                held = core.blocks.num_usable - core.blocks.num_free
                assert held == len(core.intake.requests["long"].block_table)
    assert finished["fails"] < finished["long"]
    assert_no_leak(llm)


def test_an_output_that_ends_before_its_constraint_is_complete_is_an_error():
    """The end check: an output ended by EOS where its grammar is not complete (its masks were not
    what decided it) fails, as does a last token the grammar refuses; a complete one holds."""
    from prefixgrove.catalog.byte_tokenizer import EOS_ID, VOCAB_SIZE, byte_tokenizer
    from prefixgrove.engine.structured.grammar_state import GrammarState
    from prefixgrove.engine.structured.grammars import GrammarCompiler

    compiler = GrammarCompiler(byte_tokenizer(), VOCAB_SIZE, [EOS_ID])
    grammar = compiler.compile(StructuredOutputsParams(regex="abc"))

    def settled(output: list[int]) -> str | None:
        state = GrammarState(partial(compiler.matcher, grammar), frozenset([EOS_ID]), VOCAB_SIZE,
                             "structured_outputs.regex")  # fmt: skip
        state.settle(output)
        return state.error

    assert settled([*b"abc", EOS_ID]) is None
    assert settled(list(b"ab")) is None  # cut by max_tokens: a prefix of an answer
    early = settled([*b"ab", EOS_ID])
    assert early is not None and early.startswith("structured_outputs.regex could not be enforced")
    refused = settled(list(b"abd"))
    assert refused is not None and f"failed on token {ord('d')}" in refused


UNSATISFIABLE = [
    ({"json": {"enum": []}}, "json"),
    ({"json": {"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]}}, "json"),
    ({"json": {"$ref": "#"}}, "json"),
    ({"regex": "x[a&&b]"}, "regex"),
    ({"grammar": 'root ::= "a" root'}, "grammar"),
    ({"grammar": 'start: x\nx: x "b" | "c" x'}, "grammar"),
]


@pytest.mark.parametrize(("constraint", "kind"), UNSATISFIABLE)
def test_a_constraint_no_output_meets_is_refused_up_front(
    prompts, constraint, kind, smollm2_engines
):
    """LLM.generate refuses the job before queuing any of it, naming the request and the
    constraint; the engine then runs the next job as before."""
    llm = smollm2_engines()
    good = SamplingParams(max_tokens=4, temperature=0.0)
    bad = SamplingParams(max_tokens=8, structured_outputs=constraint)
    with pytest.raises(
        ValueError, match=rf"^prompt 1: structured_outputs\.{kind} accepts no output"
    ):
        run(llm, prompts[:2], [good, bad])
    assert not llm.engine.has_unfinished_requests()
    assert run(llm, prompts[:1], good)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("endless", "ending"),
    [
        ('root ::= "a" root', 'root ::= "a" root | "b"'),
        ('root ::= ("a" root)+', 'root ::= ("a" root)?'),
        ('start: x\nx: x "b" | "c" x', 'start: x\nx: x "b" | "c"'),
        ('start: "a" x\nx: "b" x', 'start: "a" [x]\nx: "b" x'),
        ('start: item "."\nitem: "a" item', 'start: item* "."\nitem: "a" item'),
        ('start: %json {"type": "object"} x\nx: "b" x', 'start: %json {"type": "object"}'),
    ],
)
def test_a_grammar_is_refused_only_where_none_of_its_rules_can_end(endless, ending):
    """Rules that only ever lead to one another derive no string; one alternative, optional part
    or repetition that may be left out is enough for a rule to end."""
    from prefixgrove.catalog.byte_tokenizer import EOS_ID, VOCAB_SIZE, byte_tokenizer
    from prefixgrove.engine.structured.grammars import GrammarCompiler

    compiler = GrammarCompiler(byte_tokenizer(), VOCAB_SIZE, [EOS_ID])
    with pytest.raises(
        ValueError, match=r"structured_outputs\.grammar accepts no output: no rule of"
    ):
        compiler.compile(StructuredOutputsParams(grammar=endless))
    compiler.compile(StructuredOutputsParams(grammar=ending))


def test_a_choice_of_thousands_of_strings_is_enforced(prompts, smollm2_engines):
    """A choice list is one lexeme: past 2,000 strings, as alternatives of a rule, it failed every
    request at its first token."""
    choices = [f"label-{i:04d}" for i in range(3000)]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=2,
                            structured_outputs=StructuredOutputsParams(choice=choices))  # fmt: skip
    (out,) = run(smollm2_engines(), prompts[:1], params)
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text in choices
