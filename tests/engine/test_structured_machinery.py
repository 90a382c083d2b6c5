"""Structured outputs' parts below the engine, on the byte tokenizer: the params' checks, a
schema copied when the request is taken, tokenizers whose bytes would be misread refused, and the
step masks' matchers (built at their first mask, ahead of the device on builder threads oldest
first, a build that fails failing its request alone, and the same states however they were built)."""

from __future__ import annotations

import copy
import json
from functools import partial

import pytest

from prefixgrove import SamplingParams
from prefixgrove.engine.structured import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"json": SCHEMA, "regex": "a"},
        {"regex": ""},
        {"choice": []},
        {"choice": ["a", 1]},
        {"json": "{not json"},
        {"json": "[1, 2]"},
        {"json_object": False},
        {"grammar": "   "},
    ],
)
def test_params_name_what_is_wrong(fields):
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        StructuredOutputsParams(**fields)


def test_params_from_a_dict_and_cache_key():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=("a", "b"))
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"jsonschema": {}})
    with pytest.raises(ValueError, match="StructuredOutputsParams or a dict"):
        SamplingParams(structured_outputs="json")
    # a schema's spacing does not make another grammar (its key order does: test_json_schema_order)
    a = StructuredOutputsParams(json={"type": "object", "required": []})
    b = StructuredOutputsParams(json='{"type":  "object",\n "required": [] }')
    assert a.key == b.key


def test_the_engines_copy_of_a_schema_does_not_follow_later_changes_to_the_dict():
    """The engine keeps a schema as its canonical text: a dict changed after the params were
    prepared (to submit another job) does not change the constraint of the requests taken in."""
    schema: dict = {"type": "object", "properties": {"a": {"type": "integer"}}}
    user = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    kept = user.prepared(None, [0])
    before = kept.structured_outputs.key
    schema["properties"]["a"]["type"] = "string"
    assert kept.structured_outputs.key == before
    assert user.structured_outputs.key != before  # the user's own object follows its dict
    assert json.loads(kept.structured_outputs.json) == {
        "type": "object", "properties": {"a": {"type": "integer"}}}  # fmt: skip


def test_a_tokenizer_whose_token_bytes_would_be_misread_is_refused():
    """llguidance reads token bytes from the tokenizer's decoder: one it reads otherwise than the
    tokenizer decodes (as some GGUF conversions write) would constrain the wrong bytes."""
    from tokenizers import decoders

    from prefixgrove.catalog.byte_tokenizer import EOS_ID, VOCAB_SIZE, byte_tokenizer
    from prefixgrove.engine.structured.grammars import GrammarCompiler

    assert GrammarCompiler(byte_tokenizer(), VOCAB_SIZE, [EOS_ID]).compile(
        StructuredOutputsParams(regex="a+")
    )
    misread = copy.deepcopy(byte_tokenizer())
    misread.backend_tokenizer.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Fuse()]
    )
    compiler = GrammarCompiler(misread, VOCAB_SIZE, [EOS_ID])
    with pytest.raises(ValueError, match="cannot use this tokenizer"):
        compiler.compile(StructuredOutputsParams(regex="a+"))


def test_a_complete_grammar_is_reported_so_its_request_ends_without_waiting():
    """Once only EOS may follow, the masker says so: the runner then knows the request's length
    (its slot goes back when the step is enqueued, not a window later)."""
    import torch

    from prefixgrove.catalog.byte_tokenizer import EOS_ID, VOCAB_SIZE, byte_tokenizer
    from prefixgrove.engine.structured.grammar_state import GrammarState
    from prefixgrove.engine.structured.grammars import GrammarCompiler
    from prefixgrove.engine.structured.masks import StepMasker

    compiler = GrammarCompiler(byte_tokenizer(), VOCAB_SIZE, [EOS_ID])
    grammar = compiler.compile(StructuredOutputsParams(choice=["ab", "abc"]))
    states = [GrammarState(partial(compiler.matcher, grammar), frozenset([EOS_ID]), VOCAB_SIZE)
              for _ in range(3)]  # fmt: skip
    outputs = [list(b"ab"), list(b"abc"), list(b"a")]
    masker = StepMasker(torch.device("cpu"))
    mask = masker.masks(states, lambda r, start: outputs[r][start:], [len(o) for o in outputs])
    assert mask is not None
    assert mask.ends == [1]  # "ab" may still become "abc"; "a" is not complete
    allowed = (mask.bitmask[0, ord("c") // 32] >> (ord("c") % 32)) & 1
    assert int(allowed) == 1


def test_a_sequence_builds_its_matcher_when_its_first_mask_is_built():
    """Taking a request in builds no matcher (thousands would cost seconds before the first step);
    its first mask does, and a constraint that does not build fails as the request is taken in."""
    import torch

    from prefixgrove.catalog.byte_tokenizer import EOS_ID, VOCAB_SIZE, byte_tokenizer
    from prefixgrove.engine.structured.grammar_state import GrammarState
    from prefixgrove.engine.structured.grammars import GrammarCompiler
    from prefixgrove.engine.structured.masks import StepMasker

    compiler = GrammarCompiler(byte_tokenizer(), VOCAB_SIZE, [EOS_ID])
    grammar = compiler.compile(StructuredOutputsParams(choice=["ab", "cd"]))
    built: list[int] = []

    def new_matcher():
        built.append(1)
        return compiler.matcher(grammar)

    states = [GrammarState(new_matcher, frozenset([EOS_ID]), VOCAB_SIZE) for _ in range(2)]
    assert not built
    mask = StepMasker(torch.device("cpu")).masks(states, lambda r, start: [], [0, 0])
    assert len(built) == 2 and mask is not None
    assert states[0].matcher is not states[1].matcher
    for token in b"ab":  # one matcher advances, the other stays at the start
        states[0].consume(token)
    assert states[0].matcher.is_accepting() and not states[1].matcher.is_accepting()
    assert len(built) == 2


def _regex_states(count: int, regex: str = "(ab|b[a-c])+", fail_at: int | None = None):
    """`count` states of one regex on the byte tokenizer, and the list each build appends its
    state's index to (the build of state `fail_at` raises)."""
    from prefixgrove.catalog.byte_tokenizer import EOS_ID, VOCAB_SIZE, byte_tokenizer
    from prefixgrove.engine.structured.grammar_state import GrammarState
    from prefixgrove.engine.structured.grammars import GrammarCompiler

    compiler = GrammarCompiler(byte_tokenizer(), VOCAB_SIZE, [EOS_ID])
    grammar = compiler.compile(StructuredOutputsParams(regex=regex))
    built: list[int] = []

    def new_matcher(i: int):
        if i == fail_at:
            raise ValueError("structured_outputs does not compile: broken on purpose")
        built.append(i)
        return compiler.matcher(grammar)

    states = [GrammarState(partial(new_matcher, i), frozenset([EOS_ID]), VOCAB_SIZE)
              for i in range(count)]  # fmt: skip
    return states, built


def test_matchers_are_built_ahead_oldest_first_until_the_device_is_done():
    """On CUDA the host builds the matchers of requests not yet sampled while it waits for the
    device (a batch at a time on the builder threads, between looks at whether the wait is over),
    at most ahead_limit beyond those sampled, and fills their first masks, which their first step
    then takes. One a step has masked already, or an aborted one, is skipped."""
    import torch

    from prefixgrove.engine.structured.masks import _AHEAD_BATCH, StepMasker

    batch = _AHEAD_BATCH
    states, built = _regex_states(3 * batch + 2)
    # builds ahead; nothing here touches the device
    masker = StepMasker(torch.device("cuda"), builder_threads=2, ahead_limit=batch + 1)
    for s in states:
        masker.expect(s)
    assert not built
    states[1].build()  # its first step came first (as masks() marks a row it masks)
    states[1].masked = True
    states[2].ended = True  # aborted
    looks: list[int] = []
    masker.build_ahead(lambda: bool(looks.append(1)) or len(looks) > 1)  # one batch, then done
    assert sorted(built) == [0, 1, *range(3, batch + 2)]
    assert [s.next_bits is not None for s in states[: batch + 3]] == (
        [True, False, False] + [True] * (batch - 1) + [False]
    )
    assert masker.stats.matchers_built_ahead == batch
    masker.build_ahead(lambda: False)  # one more batch reaches the limit: no more
    assert sorted(built) == [0, 1, *range(3, 2 * batch + 2)]
    on_cpu = StepMasker(torch.device("cpu"))
    kept = on_cpu.masks(states[:1], lambda r, start: [], [0])
    fresh = on_cpu.masks(_regex_states(1)[0], lambda r, start: [], [0])
    assert kept is not None and fresh is not None
    assert torch.equal(kept.bitmask, fresh.bitmask) and on_cpu.stats.rows_reused == 1
    for s in states[3 : 2 * batch + 2]:
        s.masked = True
    masker.build_ahead(lambda: False)  # those sampled made room: the rest are built
    assert sorted(built) == [i for i in range(len(states)) if i != 2]
    assert all(s.next_bits is not None for s in states[2 * batch + 2 :])
    assert masker.stats.matchers_built_ahead == len(states) - 2


def test_a_build_that_fails_on_a_builder_thread_fails_its_request_alone():
    """A builder thread's error is not lost: it fails that row's state (its request then ends as an
    error), and the step masks the other rows."""
    import torch

    from prefixgrove.engine.structured.masks import StepMasker

    states, _ = _regex_states(3, fail_at=1)
    mask = StepMasker(torch.device("cpu"), builder_threads=2).masks(
        states, lambda r, start: [], [0, 0, 0]
    )
    assert mask is not None and mask.rows.tolist() == [0, 2]
    assert states[1].error is not None and "broken on purpose" in states[1].error
    assert states[0].error is None and states[2].error is None


def test_without_builder_threads_each_matcher_is_built_at_its_first_mask():
    """The CPU's default: no builder threads, nothing built ahead."""
    import torch

    from prefixgrove.engine.structured.masks import StepMasker, default_builder_threads

    assert default_builder_threads(torch.device("cpu")) == 0
    assert default_builder_threads(torch.device("cuda")) >= 1
    states, built = _regex_states(2)
    masker = StepMasker(torch.device("cpu"))
    for s in states:
        masker.expect(s)
    masker.build_ahead(lambda: False)
    assert not built
    masker.masks(states[:1], lambda r, start: [], [0])
    assert built == [0]


def test_many_rows_catch_up_on_llguidance_threads_as_one_by_one():
    """From 16 rows on, a step's tokens are consumed in parallel: the same matcher states as
    consuming them one by one (refusals and EOS included)."""
    import torch

    from prefixgrove.catalog.byte_tokenizer import EOS_ID, VOCAB_SIZE, byte_tokenizer
    from prefixgrove.engine.structured.grammar_state import GrammarState
    from prefixgrove.engine.structured.grammars import GrammarCompiler
    from prefixgrove.engine.structured.masks import StepMasker

    compiler = GrammarCompiler(byte_tokenizer(), VOCAB_SIZE, [EOS_ID])
    grammar = compiler.compile(StructuredOutputsParams(regex="[a-c]{2,6}"))
    outputs = [list(b"abcabc"[: 1 + i % 6]) for i in range(24)]
    outputs[3] = [*b"ab", EOS_ID, ord("a")]  # ends, then a token past its end
    outputs[5] = list(b"axb")  # a token the grammar refuses

    def states() -> list[GrammarState | None]:
        return [GrammarState(partial(compiler.matcher, grammar), frozenset([EOS_ID]), VOCAB_SIZE)
                for _ in outputs]  # fmt: skip

    parallel = states()
    StepMasker(torch.device("cpu")).masks(
        parallel, lambda r, start: outputs[r][start:], [len(o) for o in outputs]
    )
    alone = states()
    for state, tokens in zip(alone, outputs, strict=True):
        assert state is not None
        for token in tokens:
            state.consume(token)
    for a, b in zip(parallel, alone, strict=True):
        assert a is not None and b is not None
        assert (a.consumed, a.ended, a.matcher.is_accepting()) == (
            b.consumed, b.ended, b.matcher.is_accepting())  # fmt: skip
    assert alone[3] is not None and alone[3].ended
    assert alone[5] is not None and alone[5].ended
