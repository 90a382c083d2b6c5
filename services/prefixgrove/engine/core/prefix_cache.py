"""The prefix cache, sequence by sequence: the leading full blocks a sequence takes from the cache when
it is admitted, and the full blocks it computed, registered so that later sequences can take them.

A sequence's `block_hashes` are the hashes of its leading full blocks (see block_manager.py for the
scheme), as far as they are known. Blocks are registered when a chunk of prompt completes, so a prefix
computed earlier in the same job is found, and when the sequence lets its blocks go (the generated
tokens' blocks); a decode step does no work for the cache. Only tokens whose ids the host has seen and
whose K/V are computed are registered: a decode window runs ahead of the host, and may run past a
request's end.

Sequences whose first blocks are prefilled in the same step cannot share them (neither has them yet),
so a sequence whose first block another running sequence is computing waits for it to be cached. A
request asking for prompt_logprobs takes nothing from the cache (as in vLLM): it must compute every
prompt position to score it.
"""

from __future__ import annotations

from .block_manager import ROOT_HASH, BlockManager
from .sequence import SeqStatus, Sequence


class PrefixCache:
    def __init__(self, blocks: BlockManager, enabled: bool) -> None:
        self.blocks = blocks
        self.enabled = enabled
        # the first block's token ids -> the running sequence that computes that block now
        self._first_blocks: dict[tuple[int, ...], Sequence] = {}

    def waits(self, seq: Sequence, limit: int) -> bool:
        """Whether `seq` (holding no blocks yet) should be admitted later: another running sequence is
        computing the first block `seq` could take from the cache within its first `limit` tokens."""
        first = self._first_block(seq, limit) if _may_take(seq) else None
        owner = self._first_blocks.get(first) if first is not None else None
        if first is None or owner is None:
            return False
        if owner.status is SeqStatus.RUNNING and not owner.block_hashes:
            return True
        del self._first_blocks[first]  # it finished or was preempted without computing it
        return False

    def take(self, seq: Sequence, limit: int) -> int:
        """Takes the cached blocks that continue `seq`'s block table, up to its first `limit` tokens
        (whole blocks of known tokens only), and counts their tokens as computed; returns how many
        tokens it took. `seq` has computed exactly the blocks it holds (none, or a group's prefix)."""
        if not self.enabled or len(seq.block_hashes) != len(seq.block_table) or not _may_take(seq):
            return 0
        bs = self.blocks.block_size
        start, end = len(seq.block_table), min(limit, _num_known(seq)) // bs
        taken: list[int] = []
        if end > start:
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
            taken, hashes = self.blocks.take_cached(parent, seq.token_ids(start * bs, end * bs))
            seq.block_table += taken
            seq.block_hashes += hashes
            seq.num_computed_tokens = len(seq.block_table) * bs
        first = self._first_block(seq, limit) if not seq.block_hashes else None
        if first is not None:
            self._first_blocks.setdefault(first, seq)
        return len(taken) * bs

    def remember(self, seq: Sequence) -> None:
        """Registers `seq`'s full blocks computed since the last call whose token ids are known."""
        if not self.enabled:
            return
        bs = self.blocks.block_size
        done = len(seq.block_hashes)
        full = min(seq.num_computed_tokens, _num_known(seq)) // bs
        full = min(full, len(seq.block_table))
        if full <= done:
            return
        if not done:
            self._forget_first_block(seq)
        parent = seq.block_hashes[-1] if done else ROOT_HASH
        for i in range(done, full):
            tokens = tuple(seq.token_ids(i * bs, (i + 1) * bs))
            parent = self.blocks.register(seq.block_table[i], parent, tokens)
            seq.block_hashes.append(parent)

    def release(self, seq: Sequence) -> None:
        """Registers what `seq` computed, then lets its blocks go: the registered ones stay cached."""
        self.remember(seq)
        if self.enabled and not seq.block_hashes:
            self._forget_first_block(seq)
        self.blocks.release(seq.block_table)
        seq.block_table, seq.block_hashes, seq.num_shared_blocks = [], [], 0

    def _first_block(self, seq: Sequence, limit: int) -> tuple[int, ...] | None:
        bs = self.blocks.block_size
        if not self.enabled or min(limit, _num_known(seq)) < bs:
            return None
        return tuple(seq.token_ids(0, bs))

    def _forget_first_block(self, seq: Sequence) -> None:
        first = self._first_block(seq, seq.num_tokens)
        if first is not None and self._first_blocks.get(first) is seq:
            del self._first_blocks[first]


def _may_take(seq: Sequence) -> bool:
    """Whether a sequence may start from cached blocks: not one that needs every prompt row of its
    own (prompt logprobs, a mean-pooled embedding)."""
    return seq.params.prompt_logprobs is None and not seq.params.pools_every_row


def _num_known(seq: Sequence) -> int:
    """Tokens whose ids the host has (a sampled token still on its way is not one of them)."""
    return len(seq.prompt_token_ids) + len(seq.output_token_ids)
