"""The operator's planner client against a real planner: resuming a broken submission, credentials."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from operator_testbed import MODEL, start_planner

from prefixgrove.operator.planner_client import PlannerClient, PlannerUnavailable


def request_line(i: int) -> bytes:
    body = {"prompt": f"question {i}", "max_tokens": 1}
    return json.dumps({"custom_id": f"r{i}", "url": "/v1/completions", "body": body}).encode()


def test_a_resubmission_skips_the_lines_the_planner_already_holds(planner: PlannerClient) -> None:
    key = str(uuid.uuid4())
    lines = [request_line(i) for i in range(5)]
    first = planner.create_job(MODEL, key, {})
    assert planner.submit_lines(first.id, lines[:2]) == 2  # then the operator "crashes"
    again = planner.create_job(MODEL, key, {})
    assert (again.id, again.sealed, again.total) == (first.id, False, 2)
    assert planner.submit_lines(again.id, lines, skip=again.total) == 5
    sealed = planner.seal_job(again.id)
    assert (sealed.total, sealed.sealed) == (5, True)
    planner.cancel_job(sealed.id)


def test_the_planner_token_is_sent_and_a_wrong_one_is_retried_not_fatal(
    redis_url: str, logs_dir: Path
) -> None:
    server, address = start_planner(redis_url, logs_dir, token="s3cret")
    try:
        assert PlannerClient(address, token="s3cret").queue_depth() >= 0
        with pytest.raises(PlannerUnavailable, match="UNAUTHENTICATED"):
            PlannerClient(address, token="wrong").queue_depth()
        with pytest.raises(PlannerUnavailable, match="UNAUTHENTICATED"):
            PlannerClient(address).queue_depth()
    finally:
        server.stop()
