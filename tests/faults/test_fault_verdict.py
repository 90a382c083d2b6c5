"""What the campaign's verdict accepts and what it calls a violation, on small hand-made files."""

from __future__ import annotations

import json
from pathlib import Path

from fault_verdict import Verdict, judge

from prefixgrove.worker.runner import DIED_ALONE

POISON = frozenset({"p"})


def answer(custom_id: str, text: str = "ab", logprob: float = -1.25) -> str:
    choice = {"text": text, "logprobs": {"token_logprobs": [logprob], "top": [{"a": logprob}]}}
    return json.dumps({"custom_id": custom_id, "response": {"body": {"choices": [choice]}}})


def failure(custom_id: str, message: str = "bad line", code: str = "invalid_request") -> str:
    return json.dumps({"custom_id": custom_id, "error": {"code": code, "message": message}})


REF_OUT = [answer("a"), answer("p"), answer("b"), answer("c")]
REF_ERR = [failure("x")]
POISONED = failure("p", DIED_ALONE, "worker_failed")


def verdict(tmp_path: Path, out: list[str], err: list[str], worker_kills: int = 0) -> Verdict:
    files = []
    for name, lines in (("out", out), ("err", err), ("ref_out", REF_OUT), ("ref_err", REF_ERR)):
        path = tmp_path / name
        path.write_text("".join(line + "\n" for line in lines))
        files.append(path)
    return judge((files[0], files[1]), (files[2], files[3]), POISON, worker_kills)


def test_the_local_answers_with_the_poison_failed_alone_pass(tmp_path: Path) -> None:
    got = verdict(tmp_path, [answer("a"), answer("b"), answer("c")], [failure("x"), POISONED])
    assert got.ok and got.byte_equal


def test_a_poison_request_that_was_answered_fails_the_verdict(tmp_path: Path) -> None:
    got = verdict(tmp_path, [answer("a"), answer("p"), answer("b"), answer("c")], [failure("x")])
    assert not got.poison_ok and not got.ok


def test_a_duplicate_and_a_missing_answer_are_counted(tmp_path: Path) -> None:
    got = verdict(tmp_path, [answer("a"), answer("a"), answer("c")], [failure("x"), POISONED])
    assert (got.duplicates, got.missing) == (1, 1) and not got.ok


def test_another_text_is_a_mismatch(tmp_path: Path) -> None:
    got = verdict(tmp_path, [answer("a"), answer("b", "zz"), answer("c")], [failure("x"), POISONED])
    assert got.mismatches == 1 and not got.ok


def test_logprobs_off_in_their_last_bits_are_a_mismatch(tmp_path: Path) -> None:
    drifted = answer("b", logprob=-1.2500001)
    got = verdict(tmp_path, [answer("a"), drifted, answer("c")], [failure("x"), POISONED])
    assert got.mismatches == 1 and not got.ok and not got.byte_equal


def test_answers_out_of_input_order_fail_the_verdict(tmp_path: Path) -> None:
    got = verdict(tmp_path, [answer("b"), answer("a"), answer("c")], [failure("x"), POISONED])
    assert not got.in_order and not got.ok


def test_an_ordinary_request_failed_otherwise_fails_the_verdict(tmp_path: Path) -> None:
    failed = failure("b", "the engine raised", "worker_failed")
    got = verdict(tmp_path, [answer("a"), answer("c")], [failure("x"), failed, POISONED], 3)
    assert got.other_failed == ["b"] and not got.ok


def test_two_worker_kills_may_cost_a_request_they_caught_running_alone(tmp_path: Path) -> None:
    caught = failure("b", DIED_ALONE, "worker_failed")
    out, err = [answer("a"), answer("c")], [failure("x"), caught, POISONED]
    assert verdict(tmp_path, out, err, worker_kills=2).ok
    assert verdict(tmp_path, out, err, worker_kills=2).failed_by_kills == ["b"]
    assert not verdict(tmp_path, out, err, worker_kills=1).ok
