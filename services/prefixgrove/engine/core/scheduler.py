"""Decides what each step computes: decode first, then prefill chunks, then new work, under a token budget.

Groups: a group's prefix is a prefill-only sequence; once it is in the cache the group's requests join
ahead of new work (they reuse the prefix, so they are the cheapest tokens to finish); a new group is
admitted only when its prefix and a first wave of its requests fit in the free blocks. When blocks run
out, the most recently admitted sequence is preempted and later recomputed.

With the prefix cache, an admitted sequence (a request, or a group's prefix) first takes the cached
blocks its tokens begin with and is prefilled from there; a group's prefix found whole is ready at once.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from ..config import SchedulerConfig
from .block_manager import BlockManager
from .prefix_cache import PrefixCache
from .sequence import Group, GroupState, ScheduledSeq, SeqStatus, Sequence

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    batch: list[ScheduledSeq]

    @property
    def is_decode_only(self) -> bool:
        return all(item.num_tokens == 1 and item.sample for item in self.batch)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, blocks: BlockManager, *, prefix_caching: bool
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.cache = PrefixCache(blocks, enabled=prefix_caching)
        # ungrouped requests and not-yet-started groups
        self.waiting: deque[Sequence | Group] = deque()
        self.ready_groups: list[Group] = []  # prefix in the cache, requests still to start
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        # what admitted sequences took instead of computing: tokens, and references on blocks
        self.num_tokens_reused = 0
        self.num_blocks_reused = 0

    def add(self, item: Sequence | Group) -> None:
        self.waiting.append(item)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.ready_groups or self.running)

    @property
    def only_outputs_next(self) -> bool:
        """Whether the next step would compute running requests' output tokens alone: each running
        one has sampled (what it has left to compute are output tokens: its last one, or tokens
        jump-forward appended), and none can start, as none waits (a ready group stays listed until
        its last request ends; only its pending ones wait) or every seat is taken. Requests ending
        in a step still in flight may free seats: then the guess is wrong for one step."""
        if not all(s.num_generated > 0 for s in self.running):
            return False
        waits = self.waiting or any(group.pending for group in self.ready_groups)
        return not waits or len(self.running) >= self.config.max_num_seqs

    # -- one step ---------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preempted = False
        for seq in [s for s in self.running if s.is_decoding]:
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            while not self._reserve(seq, seq.num_computed_tokens + 1):
                preempted = True
                if self._preempt_last() is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                batch.append(ScheduledSeq(seq, 1, sample=True))
                budget -= 1
        for seq in [s for s in self.running if not s.is_decoding]:
            if budget <= 0:
                break
            n = self._fit(seq, min(seq.num_uncomputed, budget))
            if n > 0:
                batch.append(self._chunk(seq, n))
                budget -= n
        if not preempted:
            budget = self._admit(batch, budget)
        if not batch and self.running:
            self._preempt_last()  # every running prefill is starved of blocks: make room for the rest
        elif not batch and self.waiting:
            self._evict_idle_group()
        return SchedulerOutput(batch)

    def _chunk(self, seq: Sequence, n: int) -> ScheduledSeq:
        done = seq.num_computed_tokens + n == seq.num_tokens
        return ScheduledSeq(seq, n, sample=done and not seq.is_prefix)

    # -- admission --------------------------------------------------------------------------------------

    def _admit(self, batch: list[ScheduledSeq], budget: int) -> int:
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            item = self._next_candidate()
            if item is None:
                break
            seq = self._start_group(item) if isinstance(item, Group) else self._start_seq(item)
            if seq is None:
                break
            self.num_tokens_reused += seq.num_computed_tokens
            self.num_blocks_reused += len(seq.block_table)
            if seq.is_prefix and seq.num_uncomputed == 0 and seq.group is not None:
                self._prefix_ready(seq.group)  # found whole in the cache
                continue
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = self._fit(seq, min(seq.num_uncomputed, budget))
            if n > 0:
                batch.append(self._chunk(seq, n))
                budget -= n
        return budget

    def _start_group(self, group: Group) -> Sequence | None:
        """Takes a new group in and its prefix's cached blocks; None where it must wait."""
        prefix = group.prefix_seq
        if not self._fits(self._group_blocks(group)) or self.cache.waits(prefix, prefix.num_tokens):
            return None
        self.waiting.popleft()
        group.state = GroupState.COMPUTING
        self.cache.take(prefix, prefix.num_tokens)
        return prefix

    def _start_seq(self, seq: Sequence) -> Sequence | None:
        """Takes a request in, on its group's prefix where that is ready, then the cached blocks that
        follow (all but its last token may come from there); None where it must wait."""
        group = seq.group
        shared = group.prefix_blocks if group is not None and self._joins_group(seq) else []
        need = self.blocks.blocks_for(seq.num_tokens + 1) - len(shared)
        if not self._fits(need) or (not shared and self.cache.waits(seq, seq.num_tokens - 1)):
            return None
        self._take_candidate(seq)
        if group is not None and shared:
            self.blocks.share(shared)
            seq.block_table, seq.num_shared_blocks = list(shared), len(shared)
            seq.block_hashes = list(group.prefix_seq.block_hashes)
            seq.num_computed_tokens = group.prefix_len
            seq.num_shared_prefix_tokens = group.prefix_len
        self.cache.take(seq, seq.num_tokens - 1)
        if not seq.num_generated:  # a recompute after preemption keeps what its prompt took
            seq.num_cached_tokens = seq.num_computed_tokens
        return seq

    def _next_candidate(self) -> Sequence | Group | None:
        for group in self.ready_groups:
            if group.pending:
                return group.pending[0]
        return self.waiting[0] if self.waiting else None

    def _take_candidate(self, seq: Sequence) -> None:
        group = seq.group
        if group is not None and group.state is GroupState.READY and seq in group.pending:
            group.pending.remove(seq)
        else:
            self.waiting.popleft()

    def _joins_group(self, seq: Sequence) -> bool:
        return seq.group is not None and seq.group.state is GroupState.READY

    def _group_blocks(self, group: Group) -> int:
        """Blocks a new group needs before it starts: its prefix and a first wave of its requests' own
        blocks; the wave shrinks (to one request at least) where the whole cache could not hold it."""
        prefix = self.blocks.blocks_for(group.prefix_len)
        need = prefix
        for i, member in enumerate(group.pending[: self.config.first_wave]):
            own = self.blocks.blocks_for(member.num_tokens + 1) - prefix
            if i and need + own > self.blocks.num_usable:
                break
            need += own
        return need

    def _fits(self, num_blocks: int) -> bool:
        # Keep a small reserve so running requests can grow before anyone must be preempted; with nothing
        # running, the whole cache is available.
        reserve = max(1, self.blocks.num_usable // 100) if self.running else 0
        return self.blocks.num_free - num_blocks >= reserve

    def reserve_ahead(self, seqs: list[Sequence], steps: int) -> bool:
        """Reserves blocks for `steps` more tokens of every sequence (a decode window); all or nothing."""
        need = [
            self.blocks.blocks_for(s.num_computed_tokens + steps) - len(s.block_table) for s in seqs
        ]
        if not self.blocks.can_allocate(sum(n for n in need if n > 0)):
            return False
        for seq, n in zip(seqs, need, strict=True):
            if n > 0:
                seq.block_table.extend(self.blocks.allocate(n))
        return True

    # -- blocks -----------------------------------------------------------------------------------------

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.blocks.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.blocks.can_allocate(need):
            return False
        seq.block_table.extend(self.blocks.allocate(need))
        return True

    def _fit(self, seq: Sequence, n: int) -> int:
        """The largest chunk <= n whose blocks can be had now (allocated here)."""
        room = (len(seq.block_table) + self.blocks.num_free) * self.blocks.block_size
        n = min(n, room - seq.num_computed_tokens)
        if n <= 0 or not self._reserve(seq, seq.num_computed_tokens + n):
            return 0
        return n

    def _preempt_last(self) -> Sequence:
        seq = self.running.pop()
        self.num_preemptions += 1
        logger.info(
            "preempting %s (recomputed later); %d preemptions so far",
            seq.request_id,
            self.num_preemptions,
        )
        self.cache.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        group = seq.group
        if seq.is_prefix and group is not None:
            group.state = GroupState.WAITING
            self.waiting.appendleft(group)
        elif group is not None and group.state is GroupState.READY:
            group.pending.insert(0, seq)
            if group not in self.ready_groups:
                self.ready_groups.insert(0, group)
        else:
            self.waiting.appendleft(seq)
        return seq

    def _evict_idle_group(self) -> None:
        """Frees the prefix of a ready group none of whose requests run, when nothing else can move."""
        for group in reversed(self.ready_groups):
            if not any(m.status is SeqStatus.RUNNING for m in group.members):
                self.ready_groups.remove(group)
                self.cache.release(group.prefix_seq)
                group.prefix_seq.num_computed_tokens = 0
                group.state = GroupState.WAITING
                group.pending = [m for m in group.members if not m.finished]
                self.waiting.appendleft(group)
                return

    # -- after the step ---------------------------------------------------------------------------------

    def complete_chunk(self, item: ScheduledSeq) -> None:
        seq = item.seq
        seq.num_computed_tokens += item.num_tokens
        if seq.num_computed_tokens - item.num_tokens < seq.num_prompt_tokens:
            self.cache.remember(seq)  # prompt blocks: findable by what is admitted next
        if seq.is_prefix and seq.num_uncomputed == 0 and seq.group is not None:
            self.running.remove(seq)
            self._prefix_ready(seq.group)

    def _prefix_ready(self, group: Group) -> None:
        group.prefix_seq.status = SeqStatus.FINISHED
        group.state = GroupState.READY
        self.ready_groups.append(group)

    def finish(self, seq: Sequence) -> None:
        """Ends a request (done or aborted): its blocks go back; a group's prefix goes with its last one.
        Finishing a finished request again changes nothing."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.release(seq)
        seq.status = SeqStatus.FINISHED
        group = seq.group
        if group is None:
            return
        if seq in group.pending:
            group.pending.remove(seq)
        if group.num_unfinished == 0:
            self._close_group(group)

    def _close_group(self, group: Group) -> None:
        if group in self.ready_groups:
            self.ready_groups.remove(group)
        if group in self.waiting:
            self.waiting.remove(group)
        prefix = group.prefix_seq
        if prefix.status is SeqStatus.RUNNING:
            self.running.remove(prefix)
        self.cache.release(prefix)
        prefix.status = SeqStatus.FINISHED
        group.state = GroupState.DONE
