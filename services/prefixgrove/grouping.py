"""Global prefix grouping: find the shared prefixes of a whole job and form prefix groups.

Each prompt's shareable part is its first ``floor((len - 1) / block_size) * block_size`` tokens:
the engine shares whole KV blocks, and every request keeps at least one own token to produce
logits (a prompt equal to a shared prefix therefore shares one block less than the others).
The shareable parts are sorted as bytes (C-level comparisons) and the longest common prefix of
sorted neighbours, in whole blocks, defines the radix tree of the job (its LCP intervals).

Grouping rule: one prefix per request (one cascade level), the groups chosen to maximise

    value = sum over requests r of cached_r - trie({prefix_g})          (prefill saved)
            + w * sum over groups g of (size_g - 1) * prefix_g         (decode reads saved, a step)

Prefill: a group computes its prefix once, and the engine's prefix cache gives the blocks it
shares with another group's prefix, so trie({prefix_g}) counts the groups' prefix tokens once
however many groups share them (a system prompt before many documents is computed once, though
each document is a group of its own); cached_r is the longest leading part of request r that the
groups' prefixes hold (its own group's prefix at least), and the rest of it is its own to compute.
Decode: cascade attention reads a group's prefix once a step, not once per member. w
(`decode_weight`) weighs the second against the first: a step's read of a KV token costs about a
thousandth of computing one (an 8B model: 128 KiB against 16 GFLOP), over a request's hundreds of
steps. With the cache in the sum, a system prompt shared by documents of two or three requests
each no longer pulls them all into one group (each document computed per request, and the whole
job one lease); as w grows the rule becomes BatchLLM's one-level saving, sum of (size_g - 1) *
prefix_g, with its prefix enlargement (a child of k leaves merges into its parent's group when
(k - 1) * (len_child - len_parent) <= len_parent).

It is solved exactly by dynamic programming over the tree (prefix_tree.py): a request belongs to its
deepest chosen ancestor, and each node is chosen or not given the deepest chosen node above it.
Groups over ``max_group_size`` / ``max_group_tokens`` are then split into several groups with the
same prefix (the same ``prefix_id``); requests that fit in no group stay ungrouped.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from math import inf

import numpy as np

from prefixgrove.prefix_tree import PrefixTree

Prompt = Sequence[int] | np.ndarray
_U32 = next(code for code in "IL" if array.array(code).itemsize == 4)


@dataclass(frozen=True)
class GroupingConfig:
    """How groups are formed. ``max_group_tokens`` caps prefix_len + the group's own tokens."""

    min_prefix_len: int = 32
    min_group_size: int = 2
    block_size: int = 16
    max_group_size: int | None = None
    max_group_tokens: int | None = None
    # decode reads saved against prefill saved (module docstring): about 250 decode steps
    decode_weight: float = 0.25

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        _check_int("min_prefix_len", self.min_prefix_len, 1)
        _check_int("min_group_size", self.min_group_size, 2)
        if self.max_group_size is not None:
            _check_int("max_group_size", self.max_group_size, self.min_group_size)
        if self.max_group_tokens is not None:
            smallest = self.min_shared_len + self.min_group_size
            _check_int("max_group_tokens", self.max_group_tokens, smallest)
        weight = self.decode_weight
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight < inf:
            raise ValueError(
                f"GroupingConfig.decode_weight must be a finite number >= 0, got {weight!r}"
            )

    @property
    def min_shared_len(self) -> int:
        """The shortest prefix a group can have: min_prefix_len rounded up to whole blocks."""
        return -(-self.min_prefix_len // self.block_size) * self.block_size


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"GroupingConfig.{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class PrefixGroup:
    """Requests sharing ``prompts[i][:prefix_len]``, named by their positions ``i`` in the list the
    group is handed over with: what grouping, the planner, the worker and the local run hand the
    engine. Split groups of one prefix share ``prefix_id`` (0 for a group formed outside grouping).
    Whether every member really starts with the prefix is the engine's check (`LLMEngine.add_group`).
    """

    prefix_len: int
    request_indices: tuple[int, ...]
    prefix_id: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.prefix_len, bool) or not isinstance(self.prefix_len, int):
            raise ValueError(f"PrefixGroup.prefix_len must be an integer, got {self.prefix_len!r}")
        if self.prefix_len < 1:
            raise ValueError(f"PrefixGroup.prefix_len must be >= 1, got {self.prefix_len}")
        members = self.request_indices
        # One member is a group too: a worker runs a request apart as a group of one, so that it
        # keeps its group's prefix and the arithmetic of its grouped run.
        if not isinstance(members, tuple) or not members:
            raise ValueError(
                f"PrefixGroup.request_indices must be a tuple of one or more positions, got {members!r}"
            )
        if len(set(members)) != len(members) or min(members) < 0:
            raise ValueError(
                f"PrefixGroup.request_indices must be distinct positions >= 0, got {members!r}"
            )

    @property
    def size(self) -> int:
        return len(self.request_indices)

    def prefix(self, prompts: Sequence[Prompt]) -> Prompt:
        """The shared prefix tokens, sliced from the job's first member (no copy for arrays)."""
        return prompts[self.request_indices[0]][: self.prefix_len]


@dataclass(frozen=True)
class GroupingStats:
    num_requests: int
    num_tokens: int
    num_groups: int
    grouped_requests: int
    mean_group_size: float
    prefix_tokens: int
    tokens_saved: int


@dataclass(frozen=True)
class GroupingResult:
    """Groups ordered by first request index; every request is in one group or in ungrouped."""

    groups: list[PrefixGroup]
    ungrouped: list[int]
    num_requests: int
    num_tokens: int
    # the groups' prefix tokens, each counted once however many groups share it (None: each
    # group's prefix apart, for groups formed outside grouping)
    distinct_prefix_tokens: int | None = None

    @property
    def prefix_tokens_computed(self) -> int:
        """The groups' prefix tokens one engine computes: shared leading blocks once."""
        if self.distinct_prefix_tokens is not None:
            return self.distinct_prefix_tokens
        return sum(g.prefix_len for g in self.groups)

    @property
    def tokens_saved(self) -> int:
        """Prompt tokens the groups' members take from their prefixes instead of computing."""
        return sum(g.size * g.prefix_len for g in self.groups) - self.prefix_tokens_computed

    @property
    def stats(self) -> GroupingStats:
        grouped = sum(g.size for g in self.groups)
        return GroupingStats(
            num_requests=self.num_requests,
            num_tokens=self.num_tokens,
            num_groups=len(self.groups),
            grouped_requests=grouped,
            mean_group_size=grouped / len(self.groups) if self.groups else 0.0,
            prefix_tokens=sum(g.prefix_len for g in self.groups),
            tokens_saved=self.tokens_saved,
        )


def group_prompts(
    prompts: Sequence[Prompt], config: GroupingConfig | None = None
) -> GroupingResult:
    """Group a whole job's prompts (token ids in [0, 2**32)) by shared prefix."""
    cfg = config or GroupingConfig()
    lengths = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
    shareable = (lengths - 1) // cfg.block_size * cfg.block_size
    candidates = np.flatnonzero(shareable >= cfg.min_shared_len)
    keys = [_encode(prompts[i], int(shareable[i]), i) for i in candidates.tolist()]
    order = sorted(range(len(keys)), key=keys.__getitem__)
    lcp = _neighbour_lcp_blocks(keys, order, cfg.block_size)
    del keys
    tree = PrefixTree.build(lcp, len(order))
    chosen = tree.choose(cfg.block_size, cfg.min_prefix_len, cfg.min_group_size, cfg.decode_weight)
    members = tree.assign(chosen, candidates[np.asarray(order, dtype=np.int64)])
    members = _drop_small_groups(tree, chosen, members, cfg.min_group_size)
    groups: list[PrefixGroup] = []
    formed: list[int] = []  # the nodes left with a group after the size caps
    for prefix_id, (node, indices) in enumerate(sorted(members.items(), key=lambda kv: kv[1][0])):
        parts = _split(tree.depth[node] * cfg.block_size, indices, lengths, prefix_id, cfg)
        groups.extend(parts)
        if parts:
            formed.append(node)
    distinct = tree.distinct_blocks(formed) * cfg.block_size
    groups.sort(key=lambda g: g.request_indices[0])
    in_groups = np.zeros(len(prompts), dtype=bool)
    for g in groups:
        in_groups[list(g.request_indices)] = True
    ungrouped = np.flatnonzero(~in_groups).tolist()
    return GroupingResult(groups, ungrouped, len(prompts), int(lengths.sum()), distinct)


def _encode(prompt: Prompt, length: int, index: int) -> bytes:
    """Fixed-width bytes of the shareable tokens: byte order keeps equal prefixes adjacent."""
    try:
        if isinstance(prompt, np.ndarray):
            head = prompt[:length]
            if head.dtype.kind not in "iu":
                raise TypeError(f"dtype {head.dtype} is not an integer type")
            if head.size and not _fits_u32(head):
                raise OverflowError("a token id is outside [0, 2**32)")
            return head.astype(np.uint32, copy=False).tobytes()
        return array.array(_U32, prompt[:length]).tobytes()
    except (TypeError, OverflowError) as err:
        raise ValueError(
            f"prompt {index}: token ids must be integers in [0, 2**32): {err}"
        ) from err


def _fits_u32(tokens: np.ndarray) -> bool:
    unsigned = tokens.dtype.kind == "u"
    if unsigned and tokens.dtype.itemsize <= 4:
        return True
    if tokens.dtype.itemsize <= 4:
        return int(tokens.min()) >= 0
    return (unsigned or int(tokens.min()) >= 0) and int(tokens.max()) < 2**32


def _neighbour_lcp_blocks(keys: list[bytes], order: list[int], block_size: int) -> list[int]:
    """Longest common prefix, in whole blocks, of each pair of neighbours in sorted order."""
    block_bytes = 4 * block_size
    word = np.uint64 if block_bytes % 8 == 0 else np.uint32
    words_per_block = block_bytes // np.dtype(word).itemsize
    lcp: list[int] = []
    for a, b in itertools.pairwise(order):
        ka, kb = keys[a], keys[b]
        if ka[:block_bytes] != kb[:block_bytes]:
            lcp.append(0)
            continue
        n_words = min(len(ka), len(kb)) // block_bytes * words_per_block
        differ = np.frombuffer(ka, word, n_words) != np.frombuffer(kb, word, n_words)
        first = int(differ.argmax())
        lcp.append((first if differ[first] else n_words) // words_per_block)
    return lcp


def _drop_small_groups(
    tree: PrefixTree, chosen: list[bool], members: dict[int, list[int]], min_size: int
) -> dict[int, list[int]]:
    """Groups under min_group_size hand their members to the nearest chosen ancestor."""
    if all(len(m) >= min_size for m in members.values()):
        return members
    parent = tree.parent
    chosen, members = list(chosen), {v: list(m) for v, m in members.items()}
    for v in tree.postorder:
        if v not in members or len(members[v]) >= min_size:
            continue
        moved = members.pop(v)
        chosen[v] = False
        up = parent[v]
        while up != 0 and not chosen[up]:
            up = parent[up]
        if up != 0:
            members[up] = sorted(members.get(up, []) + moved)
    return members


def _split(
    prefix_len: int, indices: list[int], lengths: np.ndarray, prefix_id: int, cfg: GroupingConfig
) -> list[PrefixGroup]:
    """Cut a group into contiguous (input order) parts within the caps, sizes balanced."""
    own = lengths[indices] - prefix_len
    budget = None if cfg.max_group_tokens is None else cfg.max_group_tokens - prefix_len
    if _fits(own, cfg.max_group_size, budget):
        return [PrefixGroup(prefix_len, tuple(indices), prefix_id)]
    if budget is not None:
        fits = own <= budget
        indices, own = [i for i, f in zip(indices, fits, strict=True) if f], own[fits]
    parts = _greedy_parts(own, cfg.max_group_size, budget)
    for n_parts in (len(parts), len(parts) + 1):
        balanced = np.array_split(np.arange(len(indices)), n_parts) if indices else []
        if all(_fits(own[p], cfg.max_group_size, budget) for p in balanced):
            parts = [(int(p[0]), int(p[-1]) + 1) for p in balanced if len(p)]
            break
    return [
        PrefixGroup(prefix_len, tuple(indices[start:stop]), prefix_id)
        for start, stop in parts
        if stop - start >= cfg.min_group_size
    ]


def _greedy_parts(
    own: np.ndarray, max_size: int | None, budget: int | None
) -> list[tuple[int, int]]:
    """The fewest contiguous parts within the caps (greedy is optimal for contiguous cuts)."""
    if _fits(own, max_size, budget):
        return [(0, len(own))] if len(own) else []
    parts, start, used = [], 0, 0
    for i, tokens in enumerate(own.tolist()):
        full = max_size is not None and i - start >= max_size
        if full or (budget is not None and used + tokens > budget):
            parts.append((start, i))
            start, used = i, 0
        used += tokens
    parts.append((start, len(own)))
    return parts


def _fits(own: np.ndarray, max_size: int | None, budget: int | None) -> bool:
    return (max_size is None or len(own) <= max_size) and (
        budget is None or int(own.sum()) <= budget
    )
