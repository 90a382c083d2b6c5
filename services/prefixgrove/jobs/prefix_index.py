"""What the planner keeps of each prompt until the job is grouped: one 8-byte chained hash per whole
KV block it could share, not its tokens (an eighth of the memory of int32 tokens at block size 16).

Block k's hash covers the prompt's tokens [0, (k+1) * block_size): two prompts have equal hashes at
block k exactly when they share their first k+1 blocks (blake2b, so no input can make two differ
unseen by chance; a worker still checks every group's prefix and runs a group that fails the check
without sharing). Grouping then runs on these block ids with a block size of one.

The same hashes name a group's prefix for prefix-affine leasing (`affinity_key`): the hash of its
leading tokens cut down to a multiple of AFFINITY_LINK_TOKENS, so that two jobs whose groups share
a system prompt and a document but differ in a few tokens after it (another question template)
name one prefix, and one worker takes both.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Iterator, Sequence

import numpy as np

from prefixgrove.grouping import GroupingConfig, GroupingResult, PrefixGroup, group_prompts

# A group's affinity key covers its prefix cut down to a multiple of this many tokens (its whole
# prefix when shorter): coarse enough that prefixes of different jobs ending a little apart meet.
AFFINITY_LINK_TOKENS = 256


class PrefixIndex:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._hashes = array.array("Q")  # every prompt's shareable block hashes, one after another
        self._start = array.array("q")  # per prompt: where its hashes begin
        self._count = array.array("i")  # per prompt: how many blocks it may share

    def add(self, tokens: np.ndarray) -> None:
        # Grouping's rule: a request keeps at least one token of its own to produce logits.
        shareable = (len(tokens) - 1) // self.block_size
        data = np.ascontiguousarray(tokens[: shareable * self.block_size], dtype="<u4").tobytes()
        step = 4 * self.block_size
        self._start.append(len(self._hashes))
        self._count.append(shareable)
        digest = hashlib.blake2b(digest_size=8)
        for k in range(shareable):
            digest.update(data[k * step : (k + 1) * step])
            self._hashes.append(int.from_bytes(digest.copy().digest(), "little"))

    def __len__(self) -> int:
        return len(self._count)

    @property
    def nbytes(self) -> int:
        return sum(a.itemsize * len(a) for a in (self._hashes, self._start, self._count))

    def affinity_key(self, prompt: int, prefix_len: int) -> str:
        """The name of the first `prefix_len` tokens of prompt `prompt` (a group's shared prefix, a
        multiple of the block size) as workers advertise what they hold: its leading
        AFFINITY_LINK_TOKENS-aligned part, or all of it when shorter; "" for no prefix."""
        blocks = prefix_len // self.block_size
        link = max(AFFINITY_LINK_TOKENS // self.block_size, 1)
        blocks = blocks // link * link or blocks
        if blocks <= 0:
            return ""
        return f"{self._hashes[self._start[prompt] + blocks - 1]:016x}"

    def group(self, min_prefix_len: int, max_group_size: int | None) -> GroupingResult:
        """Groups the prompts; prefix lengths in the result are in tokens, as for token prompts."""
        bs = self.block_size
        config = GroupingConfig(
            min_prefix_len=-(-min_prefix_len // bs), block_size=1, max_group_size=max_group_size
        )
        result = group_prompts(_BlockPrompts(self), config)
        groups = [
            PrefixGroup(g.prefix_len * bs, g.request_indices, g.prefix_id) for g in result.groups
        ]
        distinct = result.prefix_tokens_computed * bs
        return GroupingResult(groups, result.ungrouped, result.num_requests, result.num_tokens * bs,
                              distinct)  # fmt: skip


class _BlockPrompts(Sequence[np.ndarray]):
    """Each prompt as its dense block ids plus one trailing slot, so that grouping's own
    `len - 1` shareable rule counts exactly the blocks the prompt may share."""

    def __init__(self, index: PrefixIndex) -> None:
        hashes = (
            np.frombuffer(index._hashes, dtype=np.uint64)
            if len(index._hashes)
            else np.zeros(0, np.uint64)
        )
        _, dense = np.unique(hashes, return_inverse=True)  # ids < 2**32, as grouping needs
        counts = (
            np.frombuffer(index._count, dtype=np.int32).astype(np.int64)
            if len(index)
            else np.zeros(0, np.int64)
        )
        owner = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        self._ids = np.zeros(len(hashes) + len(counts), dtype=np.uint32)
        self._ids[np.arange(len(hashes), dtype=np.int64) + owner] = dense.astype(np.uint32)
        self._start = np.frombuffer(index._start, dtype=np.int64) + np.arange(
            len(counts), dtype=np.int64
        )
        self._count = counts

    def __len__(self) -> int:
        return len(self._count)

    def __getitem__(self, i: int) -> np.ndarray:  # type: ignore[override]
        start = int(self._start[i])
        return self._ids[start : start + int(self._count[i]) + 1]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))
