"""Prefix grouping: what groups a job gets, and the invariants every grouping keeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

import numpy as np
import pytest
from grouping_brute_force import best_by_brute_force, value

from prefixgrove.grouping import GroupingConfig, GroupingResult, PrefixGroup, group_prompts


def toks(n: int, seed: int) -> list[int]:
    """n random token ids; different seeds share no prefix (first tokens differ)."""
    rng = np.random.default_rng(seed)
    return [seed * 7 + 100_000, *rng.integers(0, 50_000, n - 1).tolist()]


def as_sets(result: GroupingResult) -> set[tuple[int, frozenset[int]]]:
    return {(g.prefix_len, frozenset(g.request_indices)) for g in result.groups}


def check_invariants(prompts: Sequence[Sequence[int]], result: GroupingResult, cfg: GroupingConfig):
    seen = [i for g in result.groups for i in g.request_indices] + result.ungrouped
    assert sorted(seen) == list(range(len(prompts)))
    for g in result.groups:
        assert g.prefix_len % cfg.block_size == 0
        assert g.prefix_len >= cfg.min_prefix_len
        assert g.size >= cfg.min_group_size
        assert cfg.max_group_size is None or g.size <= cfg.max_group_size
        own = sum(len(prompts[i]) - g.prefix_len for i in g.request_indices)
        assert cfg.max_group_tokens is None or g.prefix_len + own <= cfg.max_group_tokens
        assert list(g.request_indices) == sorted(g.request_indices)
        prefix = list(g.prefix(prompts))
        for i in g.request_indices:
            assert list(prompts[i][: g.prefix_len]) == prefix
            assert len(prompts[i]) > g.prefix_len  # at least one own token
    firsts = [g.request_indices[0] for g in result.groups]
    assert firsts == sorted(firsts)
    assert result.ungrouped == sorted(result.ungrouped)


def test_requests_sharing_a_prefix_form_one_group() -> None:
    prefix = toks(64, 1)
    prompts = [prefix + toks(10, 10 + i) for i in range(4)]
    result = group_prompts(prompts)
    assert as_sets(result) == {(64, frozenset(range(4)))}
    assert result.ungrouped == []


def test_nested_prefixes_give_each_document_its_own_group() -> None:
    system, docs = toks(64, 1), [toks(128, 2), toks(128, 3)]
    prompts = [system + docs[i % 2] + toks(20, 10 + i) for i in range(8)]
    prompts += [system + toks(20, 30 + i) for i in range(3)]
    result = group_prompts(prompts)
    assert as_sets(result) == {
        (192, frozenset([0, 2, 4, 6])),
        (192, frozenset([1, 3, 5, 7])),
        (64, frozenset([8, 9, 10])),
    }


def test_small_child_is_enlarged_into_its_parents_group() -> None:
    system = toks(256, 1)
    prompts = [system + toks(20, 10 + i) for i in range(6)]
    extra = toks(16, 2)  # two requests share one more block
    prompts += [system + extra + toks(20, 30 + i) for i in range(2)]
    result = group_prompts(prompts)
    # Apart, the block is computed once but a 272-token prefix read more: 0.25 * 272 > 1.25 * 2 * 16 - 16
    assert as_sets(result) == {(256, frozenset(range(8)))}
    assert result.tokens_saved == 7 * 256


def test_nested_prefixes_with_few_requests_a_document_still_group_by_document() -> None:
    system, docs = toks(512, 1), [toks(256, 2 + d) for d in range(4)]
    prompts = [system + docs[d] + toks(20, 10 + 2 * d + i) for d in range(4) for i in range(2)]
    result = group_prompts(prompts)
    # One group on the system prompt would compute each document twice; a group a document
    # computes it once and takes the system prompt from the prefix cache.
    assert as_sets(result) == {(768, frozenset([2 * d, 2 * d + 1])) for d in range(4)}
    assert result.prefix_tokens_computed == 512 + 4 * 256
    assert result.tokens_saved == 8 * 768 - (512 + 4 * 256)
    # With decode reads dominant the rule is BatchLLM's: 7 * 512 saved beats 4 * 768.
    batchllm = group_prompts(prompts, GroupingConfig(decode_weight=1e6))
    assert as_sets(batchllm) == {(512, frozenset(range(8)))}


@pytest.mark.parametrize("decode_weight", [0.25, 1e6])
def test_child_merges_when_its_blocks_save_less_than_its_own_group_costs(decode_weight: float) -> None:  # fmt: skip
    system, topic, detail = toks(64, 1), toks(16, 2), toks(16, 3)
    prompts = [system + toks(20, 5)]
    prompts += [system + topic + toks(20, 10 + i) for i in range(10)]
    prompts += [system + topic + detail + toks(20, 30 + i) for i in range(3)]
    result = group_prompts(prompts, GroupingConfig(decode_weight=decode_weight))
    if decode_weight > 1:
        # BatchLLM's rule: comparing (3 - 1) * 16 with the parent's 16-token edge keeps the three
        # apart and saves 2 * 96 + 9 * 80 = 912; with the parent's whole 80-token prefix they merge.
        assert as_sets(result) == {(80, frozenset(range(1, 14)))}
        assert result.tokens_saved == 12 * 80
    else:
        # Prefill first: the detail block once, not three times (1.25 * 3 * 16 - 16 = 44 against
        # 0.25 * 96 = 24 of decode reads).
        assert as_sets(result) == {(80, frozenset(range(1, 11))), (96, frozenset(range(11, 14)))}
        assert result.tokens_saved == 10 * 80 + 3 * 96 - 96


def test_child_keeps_its_deeper_prefix_when_that_saves_more() -> None:
    system = toks(64, 1)
    prompts = [system + toks(20, 10 + i) for i in range(3)]
    prompts += [system + toks(256, 2) + toks(20, 30 + i) for i in range(3)]
    result = group_prompts(prompts)
    assert as_sets(result) == {(64, frozenset([0, 1, 2])), (320, frozenset([3, 4, 5]))}


def test_identical_prompts_share_all_but_their_last_block() -> None:
    prompts = [toks(100, 1) for _ in range(5)] + [toks(96, 2) for _ in range(3)]
    result = group_prompts(prompts)
    assert as_sets(result) == {(96, frozenset(range(5))), (80, frozenset([5, 6, 7]))}


def test_prompt_equal_to_the_prefix_joins_one_block_shorter_when_that_saves_more() -> None:
    prefix = toks(64, 1)
    prompts = [prefix + toks(10, 10 + i) for i in range(3)] + [list(prefix)]
    # Decode reads dominant: 3 * 48 tokens saved with it, 2 * 64 without it.
    result = group_prompts(prompts, GroupingConfig(decode_weight=1e6))
    assert as_sets(result) == {(48, frozenset(range(4)))}
    # Prefill first: left out, it still takes its 48 tokens from the group's cached prefix.
    result = group_prompts(prompts)
    assert as_sets(result) == {(64, frozenset(range(3)))} and result.ungrouped == [3]


def test_prompt_equal_to_the_prefix_is_left_out_when_the_group_saves_more_without_it() -> None:
    prefix = toks(64, 1)
    prompts = [prefix + toks(10, 10 + i) for i in range(10)] + [list(prefix)]
    result = group_prompts(prompts)
    assert as_sets(result) == {(64, frozenset(range(10)))}
    assert result.ungrouped == [10]


def test_huge_group_is_split_into_balanced_groups_with_the_same_prefix() -> None:
    prefix = toks(64, 1)
    prompts = [prefix + toks(10, 10 + i) for i in range(50)]
    result = group_prompts(prompts, GroupingConfig(max_group_size=16))
    assert sorted(g.size for g in result.groups) == [12, 12, 13, 13]
    assert {(g.prefix_len, g.prefix_id) for g in result.groups} == {(64, 0)}
    assert result.ungrouped == []
    assert result.tokens_saved == 49 * 64  # the four groups' one prefix is computed once


def test_group_over_max_group_tokens_is_split_within_the_cap() -> None:
    prefix = toks(64, 1)
    prompts = [prefix + toks(20, 10 + i) for i in range(12)]
    result = group_prompts(prompts, GroupingConfig(max_group_tokens=64 + 100))
    assert [g.size for g in result.groups] == [4, 4, 4]
    check_invariants(prompts, result, GroupingConfig(max_group_tokens=64 + 100))


def test_request_too_long_for_max_group_tokens_stays_ungrouped() -> None:
    prefix = toks(64, 1)
    prompts = [prefix + toks(20, 10 + i) for i in range(3)] + [prefix + toks(500, 2)]
    result = group_prompts(prompts, GroupingConfig(max_group_tokens=200))
    assert as_sets(result) == {(64, frozenset([0, 1, 2]))}
    assert result.ungrouped == [3]


def test_a_prefix_the_caps_leave_no_group_counts_nothing() -> None:
    prompts = [toks(64, 1) + toks(150, 10 + i) for i in range(2)]
    result = group_prompts(prompts, GroupingConfig(max_group_tokens=200))
    assert (result.groups, result.prefix_tokens_computed, result.tokens_saved) == ([], 0, 0)


def test_no_sharing_leaves_every_request_ungrouped() -> None:
    prompts = [toks(100, i) for i in range(20)]
    result = group_prompts(prompts)
    assert result.groups == []
    assert result.ungrouped == list(range(20))
    assert result.tokens_saved == 0


def test_prefix_len_is_rounded_down_to_whole_blocks() -> None:
    prefix = toks(50, 1)
    result = group_prompts([prefix + toks(10, 10 + i) for i in range(3)])
    assert [g.prefix_len for g in result.groups] == [48]


def test_prefix_rounding_below_min_prefix_len_is_no_group() -> None:
    prefix = toks(47, 1)
    prompts = [prefix + toks(10, 10 + i) for i in range(3)]
    result = group_prompts(prompts, GroupingConfig(min_prefix_len=40))
    assert result.groups == []


def test_prompts_shorter_than_min_prefix_len_are_ungrouped() -> None:
    prompts = [toks(20, 1) for _ in range(4)]
    result = group_prompts(prompts, GroupingConfig(min_prefix_len=32))
    assert result.groups == []
    assert result.ungrouped == [0, 1, 2, 3]


def test_groups_smaller_than_min_group_size_are_not_formed() -> None:
    prefix = toks(64, 1)
    prompts = [prefix + toks(10, 10 + i) for i in range(3)]
    assert group_prompts(prompts, GroupingConfig(min_group_size=4)).groups == []
    assert len(group_prompts(prompts, GroupingConfig(min_group_size=3)).groups) == 1


def test_too_small_group_hands_its_members_to_the_enclosing_group() -> None:
    system = toks(64, 1)
    prompts = [system + toks(256, 2) + toks(10, 10 + i) for i in range(2)]
    prompts += [system + toks(10, 20 + i) for i in range(2)]
    result = group_prompts(prompts, GroupingConfig(min_group_size=3))
    assert as_sets(result) == {(64, frozenset(range(4)))}


def test_groups_follow_input_order() -> None:
    a, b = toks(64, 1), toks(64, 2)
    order = [b, a, b, a, a, b]
    prompts = [p + toks(10, 10 + i) for i, p in enumerate(order)]
    result = group_prompts(prompts)
    assert [g.request_indices for g in result.groups] == [(0, 2, 5), (1, 3, 4)]


def test_tokens_saved_is_the_prefix_counted_once_per_extra_member() -> None:
    prompts = [toks(64, 1) + toks(10, 10 + i) for i in range(5)]
    prompts += [toks(128, 2) + toks(10, 20 + i) for i in range(3)]
    result = group_prompts(prompts)
    assert result.tokens_saved == 4 * 64 + 2 * 128
    stats = result.stats
    assert (stats.num_groups, stats.grouped_requests, stats.mean_group_size) == (2, 8, 4.0)
    assert (stats.prefix_tokens, stats.tokens_saved) == (192, 4 * 64 + 2 * 128)
    assert stats.num_tokens == sum(len(p) for p in prompts)


def test_prefix_gives_the_shared_tokens() -> None:
    prefix = toks(64, 1)
    prompts = [np.array(prefix + toks(10, 10 + i)) for i in range(3)]
    (group,) = group_prompts(prompts).groups
    assert group.prefix(prompts).tolist() == prefix


def test_numpy_and_list_prompts_group_the_same() -> None:
    prompts = random_job(np.random.default_rng(3), 40)
    cfg = GroupingConfig(min_prefix_len=8, block_size=4)
    as_arrays = [np.asarray(p, dtype=np.int64) for p in prompts]
    assert as_sets(group_prompts(prompts, cfg)) == as_sets(group_prompts(as_arrays, cfg))


def test_grouping_is_the_same_under_input_shuffles() -> None:
    rng = np.random.default_rng(4)
    prompts = random_job(rng, 200)
    cfg = GroupingConfig(min_prefix_len=8, block_size=4)
    base = as_sets(group_prompts(prompts, cfg))
    for _ in range(3):
        perm = rng.permutation(len(prompts))
        shuffled = as_sets(group_prompts([prompts[i] for i in perm], cfg))
        assert {(n, frozenset(int(perm[i]) for i in g)) for n, g in shuffled} == base


def test_grouping_does_not_depend_on_the_hash_seed() -> None:
    script = (
        "import json, numpy as np\n"
        "from prefixgrove.grouping import group_prompts, GroupingConfig\n"
        "rng = np.random.default_rng(5)\n"
        "p = [rng.integers(0, 3, rng.integers(1, 60)).tolist() for _ in range(300)]\n"
        "r = group_prompts(p, GroupingConfig(min_prefix_len=4, block_size=2))\n"
        "print(json.dumps([[g.prefix_len, g.request_indices, g.prefix_id] for g in r.groups]))\n"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1
    assert json.loads(outputs.pop())  # the job really has groups


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"min_prefix_len": 0}, "min_prefix_len"),
        ({"min_group_size": 1}, "min_group_size"),
        ({"max_group_size": 1}, "max_group_size"),
        ({"max_group_tokens": 33}, "max_group_tokens"),
        ({"block_size": 16.0}, "block_size"),
        ({"min_group_size": True}, "min_group_size"),
        ({"decode_weight": -0.5}, "decode_weight"),
        ({"decode_weight": float("nan")}, "decode_weight"),
        ({"decode_weight": float("inf")}, "decode_weight"),
    ],
)
def test_invalid_config_names_the_bad_value(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"GroupingConfig\.{field} must be .*{kwargs[field]!r}"):
        GroupingConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("prefix_len", "members", "message"),
    [
        (0, (0, 1), r"prefix_len must be >= 1, got 0"),
        (16.0, (0, 1), r"prefix_len must be an integer, got 16\.0"),
        (16, (), r"one or more positions, got \(\)"),
        (16, [0, 1], r"a tuple of one or more positions, got \[0, 1\]"),
        (16, (2, 2), r"distinct positions >= 0, got \(2, 2\)"),
        (16, (-1, 4), r"distinct positions >= 0, got \(-1, 4\)"),
    ],
)
def test_a_prefix_group_is_checked_when_it_is_made(
    prefix_len: object, members: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        PrefixGroup(prefix_len, members)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [[-1] * 40, [0.5] * 40, np.full(40, -3), np.full(40, 2**40)])
def test_invalid_token_ids_are_rejected_with_the_prompt_index(bad: Sequence[int]) -> None:
    with pytest.raises(ValueError, match="prompt 1: token ids"):
        group_prompts([list(range(40)), bad])


def random_job(rng: np.random.Generator, n: int) -> list[list[int]]:
    """Prompts built from a few shared pieces over a tiny vocabulary, so prefixes nest and collide."""
    pieces = [rng.integers(0, 3, int(rng.integers(1, 24))).tolist() for _ in range(6)]
    job = []
    for _ in range(n):
        parts = [pieces[int(i)] for i in rng.integers(0, len(pieces), int(rng.integers(0, 4)))]
        tail = rng.integers(0, 3, int(rng.integers(0, 8))).tolist()
        job.append([t for part in parts for t in part] + tail or [0])
    return job


@pytest.mark.parametrize("seed", range(25))
def test_random_jobs_keep_every_invariant(seed: int) -> None:
    rng = np.random.default_rng(seed)
    prompts = random_job(rng, int(rng.integers(1, 120)))
    block = int(rng.integers(1, 5))
    cfg = GroupingConfig(
        min_prefix_len=int(rng.integers(1, 12)),
        min_group_size=int(rng.integers(2, 4)),
        block_size=block,
        max_group_size=None if seed % 2 else int(rng.integers(3, 8)),
        max_group_tokens=None if seed % 3 else 60,
    )
    check_invariants(prompts, group_prompts(prompts, cfg), cfg)


@pytest.mark.parametrize("seed", range(60))
def test_grouping_is_worth_as_much_as_the_best_partition(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    prompts = random_job(rng, int(rng.integers(3, 9)))
    cfg = GroupingConfig(
        min_prefix_len=int(rng.integers(1, 10)),
        block_size=int(rng.integers(1, 4)),
        decode_weight=[0.0, 0.25, 1.0, 4.0][seed % 4],
    )
    result = group_prompts(prompts, cfg)
    got = value(prompts, [list(g.request_indices) for g in result.groups], cfg)
    assert got == best_by_brute_force(prompts, cfg)
