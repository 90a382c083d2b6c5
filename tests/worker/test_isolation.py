"""How the worker narrows a failing engine step down to the request that fails alone."""

from __future__ import annotations

import pytest

from prefixgrove.worker.isolation import MAX_CULPRITS_IN_A_ROW, EngineBroken, Isolation

CAUSE = RuntimeError("boom")


def test_suspects_are_halved_until_the_culprit_runs_alone() -> None:
    isolation = Isolation()
    assert isolation.failed(["a", "b", "c", "d"], CAUSE) is None
    assert isolation.active
    assert isolation.next_piece() == ["a", "b"]  # runs through
    assert isolation.next_piece() == ["c", "d"]
    assert isolation.failed(["c", "d"], CAUSE) is None
    assert isolation.next_piece() == ["c"]
    assert isolation.failed(["c"], CAUSE) == "c"
    assert isolation.next_piece() == ["d"]
    assert isolation.active  # "d" still runs alone: no new groups yet
    assert isolation.next_piece() == [] and not isolation.active


def test_requests_failing_alone_in_a_row_mean_the_engine_is_broken() -> None:
    isolation = Isolation()
    for name in "abcdef"[: MAX_CULPRITS_IN_A_ROW - 1]:
        assert isolation.failed([name], CAUSE) == name
    with pytest.raises(EngineBroken, match="boom"):
        isolation.failed(["z"], CAUSE)


def test_a_request_that_succeeds_between_culprits_resets_the_count() -> None:
    isolation = Isolation()
    for name in "abcdef"[: MAX_CULPRITS_IN_A_ROW * 2]:
        assert isolation.failed([name], CAUSE) == name
        isolation.succeeded()
