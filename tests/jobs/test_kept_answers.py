"""What a resumed `prefixgrove run` keeps of the answers in its files: only the answer to the same
request, told by the fingerprint in a success line's id or by the very error line this run gives."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from prefixgrove.jobs.kept_answers import CHANGED, NO_FINGERPRINT, ExpectedAnswers
from prefixgrove.jobs.ordered_writer import KEEP, NOT_THEIRS, Judged
from prefixgrove.jobs.output_lines import request_fingerprint, request_hash, run_tag
from prefixgrove.jobs.request_errors import RequestError

PARAMS: dict[str, Any] = {"max_tokens": 3, "temperature": 0.0, "stop": ["\n"]}
TOKENS = [1, 15, 27, 3]


def fingerprint(
    endpoint: str = "completions",
    params: dict[str, Any] = PARAMS,
    tokens: Sequence[int] = TOKENS,
    model: str | None = None,
) -> str:
    return request_fingerprint(endpoint, params, tokens, model)


def test_a_fingerprint_is_the_same_however_the_request_is_written() -> None:
    reordered = json.loads(json.dumps({"stop": ["\n"], "temperature": 0.0, "max_tokens": 3}))
    assert fingerprint(params=reordered) == fingerprint()
    assert fingerprint(tokens=tuple(TOKENS)) == fingerprint()


def test_any_change_that_can_change_the_answer_changes_the_fingerprint() -> None:
    changed = [
        fingerprint(params={**PARAMS, "max_tokens": 4}),
        fingerprint(params={**PARAMS, "seed": 7}),
        fingerprint(tokens=[*TOKENS, 9]),
        fingerprint(endpoint="chat"),
        fingerprint(model="other"),
    ]
    assert fingerprint() not in changed and len(set(changed)) == len(changed)


def test_a_json_schemas_property_order_changes_the_fingerprint_its_spacing_does_not() -> None:
    """The answer writes the properties in the schema's order, so that order is part of what
    was asked."""
    schema = {"type": "object", "properties": {"reasoning": {}, "answer": {}}}
    reordered = {"type": "object", "properties": {"answer": {}, "reasoning": {}}}
    asked = fingerprint(params={**PARAMS, "structured_outputs": {"json": schema}})
    respaced = json.loads(json.dumps({**PARAMS, "structured_outputs": {"json": schema}}, indent=2))
    assert fingerprint(params=respaced) == asked
    assert fingerprint(params={**PARAMS, "structured_outputs": {"json": reordered}}) != asked


TAG = run_tag("job_1")


def success(index: int, custom_id: str, fp: str = "", tag: str = TAG) -> str:
    line = {"id": f"batch_req_{tag}{request_hash(index, custom_id)}{fp}", "custom_id": custom_id,
            "response": {"status_code": 200}, "error": None}  # fmt: skip
    return json.dumps(line)


REFUSED = RequestError(1, "b", "context_length_exceeded", "prompt of 9 tokens + max_tokens=9")
EXPECTED = ExpectedAnswers(runs={0: ("a", fingerprint())}, fails={1: REFUSED})


def test_an_answer_to_the_same_request_is_kept() -> None:
    assert EXPECTED.judge(0, success(0, "a", fingerprint()), False) == KEEP
    assert EXPECTED.judge(1, REFUSED.to_line(TAG), True) == KEEP


def test_answers_are_kept_whatever_their_run_tag_and_the_first_ones_is_taken_up() -> None:
    """A resumed run writes its lines under the tag of the answers it keeps; ids written before
    run tags (`batch_req_<h><f>`) are read too."""
    expected = ExpectedAnswers(runs={0: ("a", fingerprint())}, fails={1: REFUSED})
    assert expected.judge(0, success(0, "a", fingerprint(), tag=""), False) == KEEP
    assert expected.kept_tag == []  # an id without a tag gives none to take up
    other = run_tag("job_2")
    assert expected.judge(0, success(0, "a", fingerprint(), tag=other), False) == KEEP
    assert expected.judge(1, REFUSED.to_line(TAG), True) == KEEP
    assert expected.kept_tag == [other]


def test_an_answer_to_a_changed_request_runs_again() -> None:
    other = fingerprint(params={**PARAMS, "max_tokens": 9})
    assert EXPECTED.judge(0, success(0, "a", other), False) == Judged(True, CHANGED)
    assert EXPECTED.judge(0, success(0, "a"), False) == Judged(True, NO_FINGERPRINT)
    engine_said_else = RequestError(1, "b", "context_length_exceeded", "prompt of 3 tokens")
    assert EXPECTED.judge(1, engine_said_else.to_line(TAG), True) == Judged(
        True, "now fails (context_length_exceeded)"
    )
    was_refused = RequestError(0, "a", "invalid_request", "no").to_line(TAG)
    now_runs = Judged(True, "was an error (invalid_request), now runs")
    assert EXPECTED.judge(0, was_refused, True) == now_runs


def test_an_answer_to_another_line_or_custom_id_is_not_this_inputs() -> None:
    assert EXPECTED.judge(0, success(1, "a", fingerprint()), False) == NOT_THEIRS
    assert EXPECTED.judge(0, success(0, "z", fingerprint()), False) == NOT_THEIRS
    assert EXPECTED.judge(0, '{"id": "something else"}', False) == NOT_THEIRS
