"""Bad input is refused up front with a ValueError that says which request and which field/value."""

from __future__ import annotations

import dataclasses

import pytest
from engine_checkpoints import engine, greedy, run

from prefixgrove import LLM, SamplingParams
from prefixgrove.grouping import PrefixGroup


@pytest.fixture(scope="module")
def llm(llama_dir: str) -> LLM:
    return engine(llama_dir, max_model_len=64)


def _assert_nothing_queued_and_still_usable(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    blocks = llm.engine.blocks
    assert blocks.num_free == blocks.num_usable
    assert len(run(llm, [[1, 2, 3]], greedy(2))[0].outputs[0].token_ids) == 2


def test_token_id_outside_the_vocabulary_names_request_and_id(llm: LLM):
    with pytest.raises(ValueError, match=r"prompt 1: .*token id 999 .*vocabulary \[0, 261\)"):
        run(llm, [[1, 2], [3, 999, 4]], greedy(2))
    _assert_nothing_queued_and_still_usable(llm)


def test_negative_token_id_is_refused(llm: LLM):
    with pytest.raises(ValueError, match=r"prompt 0: .*token id -1"):
        run(llm, [[5, -1]], greedy(2))


@pytest.mark.parametrize("bad", [2.5, "5", None], ids=["float", "str", "None"])
def test_non_integer_token_id_names_request_and_value(llm: LLM, bad: object):
    with pytest.raises(ValueError, match=rf"prompt 1: .*token id {bad!r}"):
        run(llm, [[1, 2], [3, bad]], greedy(2))  # type: ignore[list-item]
    _assert_nothing_queued_and_still_usable(llm)


def test_numpy_token_ids_are_accepted(llm: LLM):
    import numpy as np

    out = llm.generate([{"prompt_token_ids": np.array([5, 6, 7])}], greedy(2), use_tqdm=False)[0]
    assert out.prompt_token_ids == [5, 6, 7] and len(out.outputs[0].token_ids) == 2


def test_prompt_plus_max_tokens_over_max_model_len_names_request_and_numbers(llm: LLM):
    with pytest.raises(ValueError, match=r"prompt 2: .*60 tokens.*max_tokens=5.*max_model_len=64"):
        run(llm, [[1], [2], [7] * 60], greedy(5))
    _assert_nothing_queued_and_still_usable(llm)


def test_prompt_exactly_at_max_model_len_is_accepted(llm: LLM):
    out = run(llm, [[7] * 60], greedy(4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_empty_token_prompt_names_request(llm: LLM):
    with pytest.raises(ValueError, match=r"prompt 1: prompt is empty"):
        run(llm, [[1, 2], []], greedy(2))
    _assert_nothing_queued_and_still_usable(llm)


def test_empty_text_prompt_names_request(llm: LLM):
    with pytest.raises(ValueError, match=r"prompt 0: prompt is empty"):
        llm.generate([""], greedy(2), use_tqdm=False)


def test_unknown_prompt_shape_names_request(llm: LLM):
    with pytest.raises(ValueError, match=r"prompt 1: expected a string.*got int"):
        llm.generate(["ok", 42], greedy(2), use_tqdm=False)  # type: ignore[list-item]


def test_wrong_number_of_sampling_params_names_both_counts(llm: LLM):
    with pytest.raises(ValueError, match=r"got 2 sampling_params for 3 prompts"):
        run(llm, [[1], [2], [3]], [greedy(2), greedy(2)])
    _assert_nothing_queued_and_still_usable(llm)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("seed", -1),
        ("logprobs", 21),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
    ],
)
def test_invalid_sampling_params_name_field_and_value(field: str, value: object):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}={value!r} is invalid"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("top_k", 10**30, "1" + "0" * 30),
        ("max_tokens", 2**31, str(2**31)),
        ("seed", 2**64, str(2**64)),
        ("stop_token_ids", [2**63], rf"\({2**63},\)"),
        ("temperature", float("nan"), "nan"),
        ("top_p", float("inf"), "inf"),
        ("temperature", "1", "'1'"),
        ("min_p", None, "None"),
        ("presence_penalty", 10**400, r"<an integer of 1329 bits>"),
        ("top_k", True, "True"),
        ("stop", ["\ud800"], r"\('\\ud800',\)"),
        ("stop", 5, "5"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else v[:12],
)
def test_values_the_engine_cannot_hold_are_refused_with_value_error(
    field: str, value: object, shown: str
):
    """Beyond int32/int64, not finite, not a number, not UTF-8: a ValueError, never a crash later."""
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}={shown} is invalid"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("token", [10**30, 2**63], ids=["1e30", "2**63"])
def test_token_ids_beyond_int64_are_refused_and_the_engine_stays_usable(llm: LLM, token: int):
    with pytest.raises(ValueError, match=rf"prompt 0: .*token id {token} .*vocabulary"):
        run(llm, [[1, token]], greedy(2))
    _assert_nothing_queued_and_still_usable(llm)


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match=r"SamplingParams\.stop=\(''"):
        SamplingParams(stop=[""])


def test_replace_validates_again():
    with pytest.raises(ValueError, match=r"SamplingParams\.temperature=-1"):
        dataclasses.replace(SamplingParams(), temperature=-1.0)


def test_engine_validate_queues_nothing(llm: LLM):
    with pytest.raises(ValueError, match="token id 300"):
        llm.engine.validate([1, 300], greedy(1))
    assert not llm.engine.has_unfinished_requests()


def test_duplicate_request_id_is_refused(llm: LLM):
    llm.engine.add_request("dup", [1, 2, 3], greedy(1))
    try:
        with pytest.raises(ValueError, match="'dup' is already in the engine"):
            llm.engine.add_request("dup", [4, 5], greedy(1))
    finally:
        llm.engine.abort(["dup"])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_usable


def test_engine_add_request_error_names_the_request(llm: LLM):
    with pytest.raises(ValueError, match=r"'req-7'.*token id 999"):
        llm.engine.add_request("req-7", [1, 999], greedy(1))
    assert not llm.engine.has_unfinished_requests()


def test_sampling_params_accept_vllm_shorthands():
    params = SamplingParams(stop="END", stop_token_ids=None, top_k=-1)
    assert params.stop == ("END",) and params.stop_token_ids == () and params.top_k == 0
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop == ("a", "b")


def test_generate_checks_each_prompt_once(llm: LLM, monkeypatch: pytest.MonkeyPatch):
    """The whole job is checked before anything is queued; queuing does not check it again (a job holds
    millions of tokens: each pass over them costs about a second on 6,400 prompts of 2,200)."""
    calls = []
    validate = llm.engine.validate

    def counting(ids, params):
        calls.append(len(ids))
        return validate(ids, params)

    monkeypatch.setattr(llm.engine, "validate", counting)
    prompts = [[1, 2, 3, 4] * 10 + [i] for i in range(6)]  # a 40-token shared prefix: one group
    outs = run(llm, prompts, greedy(2))
    assert calls == [41] * 6
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.num_cached_tokens for o in outs] == [32] * 6  # they did run as a group


def test_prevalidated_group_still_refuses_a_request_id_in_use(llm: LLM):
    params = greedy(2)
    ids = llm.engine.validate([1, 2, 3], params)
    llm.engine.add_request("taken", ids, params, validated=True)
    members = [(rid, llm.engine.validate([1, 2, 3, 4], params), params) for rid in ("new", "taken")]
    with pytest.raises(ValueError, match="'taken' is already in the engine"):
        llm.engine.add_group("g", PrefixGroup(2, (0, 1)), members, validated=True)
    llm.engine.abort(["taken"])
    _assert_nothing_queued_and_still_usable(llm)


def test_prompt_lists_are_used_as_given_and_not_written(llm: LLM):
    """generate keeps a list prompt's ids without copying them (a job holds millions) and never
    writes to them; tuples and numpy arrays come back as lists of Python ints."""
    import numpy as np

    ids = [5, 6, 7]
    outs = llm.generate(
        [
            {"prompt_token_ids": ids},
            {"prompt_token_ids": (5, 6, 7)},
            {"prompt_token_ids": np.array(ids)},
        ],
        greedy(3, ignore_eos=True),
        use_tqdm=False,
    )
    assert ids == [5, 6, 7]
    assert outs[0].prompt_token_ids is ids
    for out in outs:
        assert out.prompt_token_ids == [5, 6, 7] and type(out.prompt_token_ids) is list
        assert out.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_huge_token_id_names_the_value(llm: LLM):
    with pytest.raises(ValueError, match=r"prompt 0: .*token id 18446744073709551616 .*vocabulary"):
        run(llm, [[1, 2**64]], greedy(2))
    _assert_nothing_queued_and_still_usable(llm)


def test_generate_leaves_nothing_frozen(llama_dir: str):
    """The job's objects are frozen for the garbage collector while it runs and thawed afterwards,
    even when something was frozen before the call: an engine's objects left frozen would keep
    their reference cycles (and the memory they hold) alive after the engine is dropped."""
    import gc
    import weakref

    gc.freeze()  # as some interpreters start
    try:
        llm = engine(llama_dir, max_model_len=64)
        llm.engine.scheduler.itself = llm.engine.scheduler  # type: ignore[attr-defined]
        cyclic = weakref.ref(llm.engine.scheduler)  # in a reference cycle: only gc frees it
        run(llm, [[1, 2, 3]], greedy(2))
        assert gc.get_freeze_count() == 0
        del llm
        gc.collect()
        assert cyclic() is None
    finally:
        gc.unfreeze()
