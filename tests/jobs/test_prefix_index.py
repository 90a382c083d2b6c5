"""Grouping on chained block hashes gives exactly the groups that grouping on tokens gives."""

from __future__ import annotations

import numpy as np
import pytest

from prefixgrove.grouping import GroupingConfig, group_prompts
from prefixgrove.jobs.prefix_index import PrefixIndex


def shared_prefix_prompts(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 300, rng.integers(10, 200)) for _ in range(rng.integers(1, 12))]
    prompts = []
    for _ in range(rng.integers(1, 300)):
        doc = docs[rng.integers(len(docs))]
        own = rng.integers(0, 300, rng.integers(1, 60))
        prompts.append(np.concatenate([doc[: rng.integers(0, len(doc) + 1)], own]).astype(np.int32))
    return prompts


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("max_group_size", [None, 2, 7])
def test_block_hash_grouping_equals_token_grouping(seed: int, max_group_size: int | None) -> None:
    prompts = shared_prefix_prompts(seed)
    expected = group_prompts(
        prompts, GroupingConfig(min_prefix_len=32, block_size=16, max_group_size=max_group_size)
    )
    index = PrefixIndex(block_size=16)
    for prompt in prompts:
        index.add(prompt)
    got = index.group(min_prefix_len=32, max_group_size=max_group_size)
    assert sorted((g.prefix_len, g.request_indices) for g in got.groups) == sorted(
        (g.prefix_len, g.request_indices) for g in expected.groups
    )
    assert got.ungrouped == expected.ungrouped and got.tokens_saved == expected.tokens_saved


def test_index_holds_eight_bytes_per_shareable_block() -> None:
    index = PrefixIndex(block_size=16)
    index.add(np.arange(1000, dtype=np.int32))  # 62 shareable blocks (one token stays its own)
    index.add(np.arange(16, dtype=np.int32))  # 16 tokens: nothing shareable
    assert len(index) == 2
    assert index.nbytes == 62 * 8 + 2 * 8 + 2 * 4


def test_an_empty_job_groups_to_nothing() -> None:
    result = PrefixIndex(block_size=16).group(min_prefix_len=32, max_group_size=None)
    assert result.groups == [] and result.ungrouped == []
