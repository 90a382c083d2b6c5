"""The requests of one `LLM.generate` call or local run, handed to the engine a window at a time.

Each request the engine holds is a sequence with its own copy of its params (a few KB), so a job
of a hundred thousand short requests queued at once held hundreds of MB before its first step.
The feed keeps at most `window` requests in the engine: whole groups (a group goes in at once,
whatever its size), then the requests of no group, in the order `generate` always queued them,
topped up as requests finish. A window of at least 8,192 requests, and 16 times the batch, leaves
every job the scheduler could fill its batches from (the canonical job, 6,400 requests, goes in
whole) and caps what a larger one holds at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from functools import partial
from typing import Any

from prefixgrove.grouping import PrefixGroup

from .sampling.sampling_params import SamplingParams

MIN_WINDOW = 8192


def feed_window(max_num_seqs: int) -> int:
    """How many requests the engine holds at most, for a batch of `max_num_seqs`."""
    return max(MIN_WINDOW, 16 * max_num_seqs)


class RequestFeed:
    def __init__(
        self,
        engine: Any,
        request_ids: list[str],
        texts: list[str | None],
        token_ids: list[list[int]],
        params: list[SamplingParams],
        groups: Seq[PrefixGroup],
        window: int,
    ) -> None:
        self.engine, self.window = engine, window
        self.queued = 0  # requests handed to the engine and not finished yet
        self._adds = self._units(request_ids, texts, token_ids, params, groups)
        self._done = False

    def _units(
        self,
        request_ids: list[str],
        texts: list[str | None],
        token_ids: list[list[int]],
        params: list[SamplingParams],
        groups: Seq[PrefixGroup],
    ) -> Iterator[tuple[int, Callable[[], None]]]:
        """(requests, how to add them) of each group, then of each request of no group."""
        requests = list(zip(request_ids, token_ids, params, strict=True))
        grouped: set[int] = set()
        for g, group in enumerate(groups):
            gid = f"{request_ids[0]}-g{g}"
            add = partial(self.engine.add_group, gid, group, requests, validated=True)
            yield len(group.request_indices), add
            grouped.update(group.request_indices)
        for i, rid in enumerate(request_ids):
            if i not in grouped:
                yield 1, partial(self.engine.add_request, rid, token_ids[i], params[i],
                                 prompt=texts[i], validated=True)  # fmt: skip

    def top_up(self) -> None:
        """Hands the engine requests until it holds `window` (or none are left)."""
        while not self._done and self.queued < self.window:
            unit = next(self._adds, None)
            if unit is None:
                self._done = True
                return
            size, add = unit
            add()
            self.queued += size

    def finished(self, count: int) -> None:
        self.queued -= count
