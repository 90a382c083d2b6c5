"""Paged KV-cache blocks with reference counts, and the cache of full blocks' contents over them.

A block holds `block_size` consecutive tokens of one sequence's KV. A group's prefix blocks are shared by
all of its requests: each holder takes a reference. Block 0 is never handed out: padded tokens of a
CUDA-graph batch write their K/V there.

Every other block is in one of three states:
- held: its reference count is above 0;
- cached: no holder, but its content is registered (below): it may be taken again as it is;
- free: no holder and no registered content.

A full block's content is registered under the key (parent hash, its token ids): the parent hash names
every token before the block, and a hash is a number handed out once per registration, never reused. A
key therefore names exactly one run of tokens from position 0, and a hit is exact, never a collision.
Cached blocks count as free (`num_free`): an allocation takes free blocks first, then evicts the least
recently released cached block, which forgets its content.
"""

from __future__ import annotations

from collections import OrderedDict, deque

NULL_BLOCK = 0
ROOT_HASH = 0  # the parent hash of a sequence's first block
# (parent hash, the block's token ids)
BlockKey = tuple[int, tuple[int, ...]]


class OutOfBlocks(Exception):
    """Raised when an allocation cannot be met; the scheduler answers it by preempting."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks={num_blocks}: the KV cache needs at least 2 blocks (one reserved)"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        # cached blocks without a holder, least recently released first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._block_of: dict[BlockKey, int] = {}
        self._content: dict[int, tuple[BlockKey, int]] = {}  # block -> (its key, its hash)
        self._last_hash = ROOT_HASH

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached(self) -> int:
        """Blocks whose content is registered, held or not."""
        return len(self._content)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free:
            raise OutOfBlocks(f"need {num_blocks} blocks, {self.num_free} free")
        blocks = [self._take_free() for _ in range(num_blocks)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def _take_free(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        key, _ = self._content.pop(block)
        del self._block_of[key]
        return block

    def share(self, blocks: list[int]) -> None:
        """Takes one more reference on blocks someone already holds (a group's prefix)."""
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise ValueError(f"block {b} is not allocated and cannot be shared")
            self._ref_counts[b] += 1

    def release(self, blocks: list[int]) -> None:
        # Last block first: of one sequence's blocks, its tail is the least likely to be asked for
        # again, so it is the first to be evicted.
        for b in reversed(blocks):
            count = self._ref_counts[b] - 1
            if count < 0:
                raise ValueError(f"block {b} released more often than it was taken")
            self._ref_counts[b] = count
            if count == 0:
                if b in self._content:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def num_shared(self) -> int:
        """Blocks held by more than one sequence right now."""
        return sum(1 for c in self._ref_counts if c > 1)

    # -- contents of full blocks ----------------------------------------------------------------------

    def register(self, block: int, parent_hash: int, token_ids: tuple[int, ...]) -> int:
        """Registers the content of a held, full block whose K/V are computed (or enqueued); returns its
        hash. Where that content is registered already (another block computed the same tokens),
        that block's hash is returned and `block` stays unregistered."""
        if self._ref_counts[block] <= 0:
            raise ValueError(f"block {block} is not held: only a holder may register its content")
        if len(token_ids) != self.block_size:
            raise ValueError(
                f"block {block}: {len(token_ids)} token ids registered, a full block holds "
                f"{self.block_size}"
            )
        key = (parent_hash, token_ids)
        known = self._block_of.get(key)
        if known is not None:
            return self._content[known][1]
        if block in self._content:
            raise ValueError(f"block {block} is registered already, under other tokens")
        self._last_hash += 1
        self._block_of[key] = block
        self._content[block] = (key, self._last_hash)
        return self._last_hash

    def reset_cache(self) -> None:
        """Forgets every registered content: cached blocks become free, held ones stay held."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._block_of.clear()
        self._content.clear()

    def take_cached(self, parent_hash: int, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Takes a reference on each cached block that continues `parent_hash` with the full blocks of
        `token_ids`, in order, up to the first that is not cached; returns the blocks and their hashes."""
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[int] = []
        for start in range(0, len(token_ids) - bs + 1, bs):
            block = self._block_of.get((parent_hash, tuple(token_ids[start : start + bs])))
            if block is None:
                break
            parent_hash = self._content[block][1]
            blocks.append(block)
            hashes.append(parent_hash)
        for b in blocks:
            if self._ref_counts[b] == 0:
                del self._evictable[b]
            self._ref_counts[b] += 1
        return blocks, hashes
