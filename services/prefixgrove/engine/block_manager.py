"""Paged KV-cache blocks with reference counts.

A block holds `block_size` consecutive tokens of one sequence's KV. A group's prefix blocks are shared by
all of its requests: each holder takes a reference, and a block returns to the free list when the last
reference goes. Block 0 is never handed out: padded tokens of a CUDA-graph batch write their K/V there.
"""

from __future__ import annotations

from collections import deque

NULL_BLOCK = 0


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

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise OutOfBlocks(f"need {num_blocks} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Takes one more reference on blocks someone already holds (a group's prefix)."""
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise ValueError(f"block {b} is not allocated and cannot be shared")
            self._ref_counts[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            count = self._ref_counts[b] - 1
            if count < 0:
                raise ValueError(f"block {b} released more often than it was taken")
            self._ref_counts[b] = count
            if count == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def num_shared(self) -> int:
        """Blocks held by more than one sequence right now."""
        return sum(1 for c in self._ref_counts if c > 1)
