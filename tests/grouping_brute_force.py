"""The value grouping.py maximises, computed by hand for any partition of a job into groups, and
the best partition found by trying them all: what the exact DP is checked against on small jobs."""

from __future__ import annotations

from collections.abc import Iterator

from prefixgrove.grouping import GroupingConfig


def partitions(items: list[int]) -> Iterator[list[list[int]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]


def common_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def value(prompts: list[list[int]], groups: list[list[int]], cfg: GroupingConfig) -> float:
    """grouping.py's value of these groups (parts too small or sharing too little are no group):
    each request's longest prefix some group's prefix holds, less the distinct prefix tokens,
    plus the decode reads saved, weighted."""
    b = cfg.block_size
    heads = [p[: (len(p) - 1) // b * b] for p in prompts]
    prefixes = []
    for group in groups:
        common = min(common_len(heads[group[0]], heads[i]) for i in group) // b * b
        if len(group) >= cfg.min_group_size and common >= cfg.min_prefix_len:
            prefixes.append((heads[group[0]][:common], len(group)))
    trie = {tuple(p[: k * b]) for p, _ in prefixes for k in range(1, len(p) // b + 1)}
    cached = sum(max([common_len(h, p) // b * b for p, _ in prefixes], default=0) for h in heads)
    decode = sum((size - 1) * len(p) for p, size in prefixes)
    return cached - len(trie) * b + cfg.decode_weight * decode


def best_by_brute_force(prompts: list[list[int]], cfg: GroupingConfig) -> float:
    """The most value any partition of the job into groups has."""
    return max(value(prompts, part, cfg) for part in partitions(list(range(len(prompts)))))
