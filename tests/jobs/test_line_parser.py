"""Lines parsed in worker processes come back exactly as parse_line gives them here, in order:
fuzzed lines (hostile text, huge and deep values, broken JSON) split across processes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from request_strategies import request_lines

from prefixgrove.jobs.line_parser import LineParser, LineRules, parse_slice
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.jobs.requests import BatchRequest

RULES = LineRules(max_line_bytes=4096, default_max_tokens=16)


@pytest.fixture(scope="module")
def pool() -> Iterator[LineParser]:
    parser = LineParser(RULES, processes=2)
    parser.warm_up()
    yield parser
    parser.close()


def plain(item: BatchRequest | RequestError) -> tuple[Any, ...]:
    """An item as comparable values (a request's token ids as a list)."""
    if isinstance(item, RequestError):
        return ("error", item.index, item.custom_id, item.code, item.message)
    ids = None if item.prompt_token_ids is None else item.prompt_token_ids.tolist()
    return (item.index, item.custom_id, item.endpoint, item.params, item.prompt_text, ids,
            item.messages)  # fmt: skip


lines = st.lists(request_lines("r"), min_size=64, max_size=96)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=lines, first=st.integers(0, 10**6))
def test_the_pool_parses_exactly_as_parse_line_does(
    pool: LineParser, batch: list[bytes], first: int
) -> None:
    here = [plain(item) for item in parse_slice(batch, first, RULES)]
    assert [plain(item) for item in pool.parse(batch, first)] == here
    indices = [item.index for item in pool.parse(batch, first)]
    assert indices == list(range(first, first + len(batch)))


def test_a_token_id_prompt_comes_back_as_the_same_int64_array(pool: LineParser) -> None:
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": ' \
           b'{"prompt": [1, 2, 2147483647], "max_tokens": 3}}'  # fmt: skip
    items = pool.parse([line] * 100, 7)
    assert all(isinstance(item, BatchRequest) for item in items)
    request = items[-1]
    assert isinstance(request, BatchRequest) and request.index == 106
    assert request.prompt_token_ids is not None and request.prompt_token_ids.dtype.name == "int64"
    assert request.prompt_token_ids.tolist() == [1, 2, 2147483647]


def test_one_process_parses_here_without_a_pool() -> None:
    parser = LineParser(RULES, processes=1)
    items = parser.parse([b"not json"] * 100, 0)
    assert {item.code for item in items if isinstance(item, RequestError)} == {"invalid_json"}
    parser.close()
