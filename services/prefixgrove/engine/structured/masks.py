"""The token masks of a step's constrained rows, from each row's GrammarState (grammar_state.py).

A step's masks are built on the host from every token sampled before it, including tokens the host has
not taken in yet (a step launched ahead, earlier steps of a decode window): the model runner waits for
those, which the GPU has produced while it runs this step's forward pass, so building the masks overlaps
the GPU's work and unconstrained rows keep their decode windows. The matchers of a step's rows are
advanced and their masks filled on llguidance's threads, without the GIL.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeAlias

import llguidance
import llguidance.numpy as llnp
import numpy as np
import torch

from ..device import to_device
from .grammar_state import GrammarState

# from this many matchers on, a step's tokens are consumed on llguidance's threads
_PARALLEL_ROWS = 16
# matchers built ahead between looks at whether the wait is over (spread over the builder threads), whose first masks are then filled together
_AHEAD_BATCH = 16
# states built ahead and not sampled yet, at most: a matcher and its first mask hold a vocabulary's
# bits and more, and a job of a million requests must not hold them all at once
_AHEAD_LIMIT = 2048
_Rows: TypeAlias = "Seq[GrammarState | None]"
TokensFrom: TypeAlias = Callable[[int, int], Seq[int]]


def default_builder_threads(device: torch.device) -> int:
    """Threads that build matchers, only while the host would wait anyway (a step's new rows, the
    batches built ahead): none on the CPU, whose cores run the model; on CUDA a quarter of the
    host's cores, at most 4 (a build holds no GIL). Threads building beside the host's own work
    slowed it: the GIL's hand-overs slowed taking a job in several times over (benchmarks/HISTORY.md)."""
    if device.type != "cuda":
        return 0
    return max(1, min(4, (os.cpu_count() or 1) // 4))


@dataclass
class MaskStats:
    """What building masks cost: host seconds (catching matchers up and filling masks, waiting for
    tokens included), the part spent waiting for tokens from the device, steps and rows masked, and
    on CUDA the device's idle gaps between a step's forward pass and its sampling (it waits for the
    mask), as event pairs read by gpu_idle_seconds, while measure_idle is set (benchmarks)."""

    seconds: float = 0.0
    wait_seconds: float = 0.0
    fill_seconds: float = 0.0  # of `seconds`, filling masks on llguidance's threads
    steps: int = 0
    rows: int = 0
    # of `rows`, masks filled before their step (GrammarState.next_bits): by jump-forward, or as
    # the matcher was built ahead
    rows_reused: int = 0
    # matchers built, and their first masks filled, while the host waited for the device
    matchers_built_ahead: int = 0
    measure_idle: bool = False
    idle_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    def gpu_idle_seconds(self) -> float:
        """Sums (and forgets) the recorded gaps; waits for their events."""
        total = 0.0
        for start, end in self.idle_events:
            end.synchronize()
            total += start.elapsed_time(end) / 1000
        self.idle_events.clear()
        return total


@dataclass
class TokenMask:
    """The rows a step constrains and their allowed tokens, one bit per token id, on the device."""

    rows: torch.Tensor  # [k] int64 rows of the step's logits
    bitmask: torch.Tensor  # [k, ceil(vocab / 32)] int32
    ends: list[int]  # rows (of the step) whose grammar is complete: only EOS may follow


def only_tokens(bits: np.ndarray) -> list[tuple[int, int]]:
    """(row, token) for each row of a bitmask [rows, words] (uint32) with exactly one bit set."""
    nonzero = bits != 0
    rows = np.flatnonzero(np.count_nonzero(nonzero, axis=1) == 1)
    if not len(rows):
        return []
    words = nonzero[rows].argmax(axis=1)
    values = bits[rows, words]
    single = (values & (values - np.uint32(1))) == 0
    bit = np.log2(values[single]).astype(np.int64)  # a power of two: exact
    return list(zip(rows[single].tolist(), (words[single] * 32 + bit).tolist(), strict=True))


class StepMasker:
    """Builds the token masks of a step's constrained rows."""

    def __init__(
        self,
        device: torch.device,
        jump_forward: bool = False,
        builder_threads: int | None = None,
        ahead_limit: int = _AHEAD_LIMIT,
    ) -> None:
        self.device = device
        self.jump_forward = jump_forward  # whether masks are kept for note_only_tokens
        self._executor: llguidance.LLExecutor | None = None
        self.stats = MaskStats()
        # masks built since note_only_tokens last looked: (host bits, (state, output index) per row)
        self._recent: list[tuple[np.ndarray, list[tuple[GrammarState, int]]]] = []
        threads = default_builder_threads(device) if builder_threads is None else builder_threads
        self._builders = (
            ThreadPoolExecutor(threads, thread_name_prefix="grammar-build") if threads else None
        )
        # On CUDA (the host waits there), states noted by `expect`, in the order their requests
        # came in (about the order they are scheduled), whose matchers build_ahead may build; and
        # those it built that no step has masked yet (at most ahead_limit)
        self._builds_ahead = device.type == "cuda"
        self._ahead_limit = ahead_limit
        self._unbuilt: deque[GrammarState] = deque()
        self._ahead: list[GrammarState] = []

    def expect(self, state: GrammarState) -> None:
        """Notes a new sequence's state, whose matcher build_ahead may build before its first mask."""
        if self._builds_ahead:
            self._unbuilt.append(state)

    def _build(self, states: list[GrammarState]) -> None:
        """Builds the matchers of `states` not built yet, on the builder threads where there are."""
        unbuilt = [s for s in states if not s.built]
        if self._builders is not None and len(unbuilt) > 1:
            for _ in self._builders.map(GrammarState.build, unbuilt):
                pass  # an error other than a failed build (which fails its state) is raised here
        else:
            for state in unbuilt:
                state.build()

    def build_ahead(self, done: Callable[[], bool]) -> None:
        """Builds the matchers of states noted by `expect`, oldest first, a batch at a time, and
        fills their first masks together on llguidance's threads (a new matcher's first mask costs
        more than later ones), kept for the step that samples first (GrammarState.next_bits); until
        `done()` says what the host waits for has come, none is left, or ahead_limit built ahead
        wait for their first step. A job's thousands of matchers and first masks are made in time
        the host would spend waiting, not on the path between a step's forward pass and its
        sampling."""
        self._ahead = [s for s in self._ahead if not (s.masked or s.ended)]
        while self._unbuilt and len(self._ahead) < self._ahead_limit and not done():
            fresh: list[GrammarState] = []
            while self._unbuilt and len(fresh) < _AHEAD_BATCH:
                state = self._unbuilt.popleft()
                # (one ended before its first step was aborted)
                if not (state.built or state.masked or state.ended):
                    fresh.append(state)
            self._build(fresh)
            fresh = [s for s in fresh if s.constrains]
            if not fresh:
                continue
            bits = self._filled(fresh)
            for i, state in enumerate(fresh):
                state.next_bits = (0, bits[i])
            self._ahead += fresh
            self.stats.matchers_built_ahead += len(fresh)

    def masks(self, states: _Rows, tokens_from: TokensFrom, produced: Seq[int]) -> TokenMask | None:
        """The masks for rows whose state constrains. `produced[r]` is how many output tokens row r
        sampled before this step; `tokens_from(r, i)` returns those from the i-th on (called only
        for rows whose matcher has not consumed them all)."""
        start = time.perf_counter()
        self._catch_up(states, tokens_from, produced)
        rows = [r for r, state in enumerate(states) if state is not None and state.constrains]
        if not rows:
            self.stats.seconds += time.perf_counter() - start
            return None
        vocab = states[rows[0]].matcher_vocab  # type: ignore[union-attr]
        bitmask = llnp.allocate_token_bitmask(len(rows), vocab)
        bits = bitmask.view(np.uint32)
        self._fill_rows(states, rows, bitmask, bits)
        ends = self._allow_eos(states, rows, bits, vocab)
        rows_at = to_device(np.array(rows, dtype=np.int64), self.device)
        mask = TokenMask(rows_at, to_device(bitmask, self.device), ends)
        if self.jump_forward:  # looked at later, off the step's critical path, for forced tokens
            self._recent.append((bits, [(states[r], produced[r]) for r in rows]))  # type: ignore[misc]
        self.stats.seconds += time.perf_counter() - start
        self.stats.steps += 1
        self.stats.rows += len(rows)
        return mask

    def _fill_rows(
        self, states: _Rows, rows: list[int], bitmask: np.ndarray, bits: np.ndarray
    ) -> None:
        """Row i of `bits` (`bitmask` as uint32): next_bits kept for this step, else filled now. A
        matcher that fails filling its row fails its state (the row then allows EOS alone, which
        ends the request as an error, not as a complete output)."""
        to_fill, filled = [], []
        for i, r in enumerate(rows):
            state = states[r]
            assert state is not None
            kept, state.next_bits = state.next_bits, None
            if kept is not None and kept[0] == state.consumed:
                bits[i] = kept[1]
                self.stats.rows_reused += 1
            else:
                to_fill.append((state.matcher, i))
                filled.append(state)
        filling = time.perf_counter()
        if to_fill:
            llnp.fill_next_token_bitmask_par(self.executor, to_fill, bitmask)
        self.stats.fill_seconds += time.perf_counter() - filling
        for state in filled:
            state.check_matcher()

    @staticmethod
    def _allow_eos(states: _Rows, rows: list[int], bits: np.ndarray, vocab: int) -> list[int]:
        """Allows every EOS where a grammar is complete; the rows where only EOS may follow."""
        ends = []
        for i, r in enumerate(rows):
            state = states[r]
            assert state is not None
            if state.matcher.is_accepting():
                eos = [t for t in state.eos_token_ids if t < vocab]
                for t in eos:  # every EOS of the model ends a complete output
                    bits[i, t >> 5] |= np.uint32(1 << (t & 31))
                if eos and int(np.bitwise_count(bits[i]).sum()) == len(eos):
                    ends.append(r)
        return ends

    def _filled(self, states: Seq[GrammarState]) -> np.ndarray:
        """The next-token masks of `states`' matchers as they stand, a row each ([rows, words]
        uint32), filled together on llguidance's threads."""
        bitmask = llnp.allocate_token_bitmask(len(states), states[0].matcher_vocab)
        llnp.fill_next_token_bitmask_par(
            self.executor, [(state.matcher, i) for i, state in enumerate(states)], bitmask
        )
        for state in states:
            state.check_matcher()  # (as in _fill_rows)
        return bitmask.view(np.uint32)

    @property
    def executor(self) -> llguidance.LLExecutor:
        """llguidance's thread pool, made when first needed."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor

    def note_only_tokens(self) -> None:
        """Marks each state whose latest mask (of those built since the last call) allowed exactly one
        token, and not an EOS, with that token and its output index (GrammarState.only_token)."""
        recent, self._recent = self._recent, []
        for bits, owners in recent:
            for i, token in only_tokens(bits):
                state, index = owners[i]
                if token not in state.eos_token_ids:
                    state.only_token = (index, token)

    def forget_recent(self) -> None:
        """Drops the masks kept for note_only_tokens (jump-forward passes over them)."""
        self._recent = []

    def forced_runs(self, starts: Seq[tuple[GrammarState, int]]) -> list[list[int]]:
        """For each (state, limit) whose `only_token` is the next token it consumes: that token and
        the tokens that then follow it alone (each the one token its grammar allows, never an EOS), at
        most `limit` in all, consumed by the state's matcher as they are found. The matchers of all
        rows advance together, a token a round, their masks filled on llguidance's threads. A run
        ends at a mask that allows more than one token (or only EOS): that mask is kept for the step
        that samples there (GrammarState.next_bits), which would otherwise fill it again."""
        runs: list[list[int]] = []
        live: list[int] = []
        for i, (state, limit) in enumerate(starts):
            assert state.only_token is not None and state.only_token[0] == state.consumed
            token = state.only_token[1]
            state.only_token = None
            state.consume(token)
            runs.append([token])
            if limit > 1 and self._may_force(state):
                live.append(i)
        while live:
            bits = self._filled([starts[i][0] for i in live])
            forced = dict(only_tokens(bits))
            still = []
            for j, i in enumerate(live):
                state, limit = starts[i]
                next_token = forced.get(j)
                if next_token is None or next_token in state.eos_token_ids:
                    state.next_bits = (state.consumed, bits[j].copy())  # the run ends here
                    continue
                state.consume(next_token)
                runs[i].append(next_token)
                if len(runs[i]) < limit and self._may_force(state):
                    still.append(i)
            live = still
        return runs

    @staticmethod
    def _may_force(state: GrammarState) -> bool:
        # an accepting grammar also allows EOS (added to masks beside the matcher's own bits)
        return state.constrains and not state.matcher.is_accepting()

    def _catch_up(self, states: _Rows, tokens_from: TokensFrom, produced: Seq[int]) -> None:
        """Each row's matcher consumes, in order, the tokens sampled before this step: the k-th
        of all rows at once on llguidance's threads (a window's step adds a token to every row)."""
        # Rows sampling for the first time build their matchers (on the builder threads) before the
        # wait for the tokens in flight below, in time the host would spend waiting.
        present = [s for s in states if s is not None]
        self._build(present)
        for s in present:
            s.masked = True
        behind = {
            r: tokens_from(r, state.consumed)[: produced[r] - state.consumed]
            for r, state in enumerate(states)
            if state is not None and state.consumed < produced[r]
        }
        depth = max((len(tokens) for tokens in behind.values()), default=0)
        for k in range(depth):
            batch: list[tuple[llguidance.LLMatcher, int]] = []
            owners: list[GrammarState] = []
            for r, tokens in behind.items():
                if k >= len(tokens):
                    continue
                state = states[r]
                assert state is not None
                token = int(tokens[k])
                if state.take(token):
                    batch.append((state.matcher, token))
                    owners.append(state)
            if len(batch) < _PARALLEL_ROWS:
                accepted = [matcher.consume_token(token) for matcher, token in batch]
            else:
                accepted = self.executor.consume_token_par(batch)
            for state, ok, (_, token) in zip(owners, accepted, batch, strict=True):
                if not ok:
                    state.refused(token)
