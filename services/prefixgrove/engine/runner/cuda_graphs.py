"""CUDA graphs of the decode forward pass (model and logits) at a ladder of padded batch sizes.

A decode step of the 8B model launches about a thousand kernels; replaying a graph launches them for the
price of one call. Each size is captured twice when cascade attention is on: with and without a prefix
pass. Inputs are the input builder's fixed arena regions, so a replay only needs the arena uploaded.
Every graph writes its logits into one shared buffer: each graph's own output would stay allocated for
as long as the graph lives (about 4.4 GiB over the ladder at 512 requests and Llama-3's 128K vocabulary,
9.5 GiB at 768), memory the KV cache was sized without.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..core.sequence import ScheduledSeq
from .input_builder import CASCADE_MIN_SEQS, InputBuilder, StepInputs

logger = logging.getLogger(__name__)

GRAPH_GROUP_ROWS = 16
# (inputs, out) -> logits [rows, vocab] fp32, written into `out` when it is given
Forward = Callable[[StepInputs, torch.Tensor | None], torch.Tensor]


def batch_size_ladder(max_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to 128 and of 32 beyond (padding wastes at most ~20%)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_seqs]
    step, size = 16, 16
    while size < max_seqs:
        sizes.append(size)
        step = 16 if size < 128 else 32
        size += step
    sizes.append(max_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(
        self, builder: InputBuilder, forward: Forward, max_seqs: int, cascade: bool
    ) -> None:
        self.builder = builder
        self.forward = forward
        self.sizes = batch_size_ladder(max_seqs)
        self.variants = (False, True) if cascade else (False,)
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None  # the graphs' shared memory pool, from the first capture
        self._logits: torch.Tensor | None = None  # [max size, vocab]: every graph's output rows
        self._last: tuple[int, bool] | None = None

    @staticmethod
    def _groups_for(size: int) -> int:
        return max(1, size // CASCADE_MIN_SEQS)

    def capture(self) -> None:
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory pool
            for cascade in self.variants:
                inputs = self._fill([], [], size, cascade)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compiles the Triton kernels, settles the allocator
                        warm = self.forward(inputs, None)
                torch.cuda.current_stream().wait_stream(stream)
                if self._logits is None:  # the largest size comes first
                    self._logits = warm.new_empty(warm.shape)
                del warm
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    logits = self.forward(inputs, self._logits[:size])
                if self._pool is None:
                    self._pool = graph.pool()
                self._graphs[(size, cascade)] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("captured %d decode graphs (batch sizes %s)", len(self._graphs), self.sizes)

    def _fill(
        self, order: list[ScheduledSeq], groups: list[range], size: int, cascade: bool
    ) -> StepInputs:
        return self.builder.fill(
            order,
            groups,
            pad_seqs=size,
            pad_groups=self._groups_for(size) if cascade else None,
            # A tile-shape hint, not a bound (the prefix pass tiles bigger groups): decode groups are
            # a handful to a few dozen requests, whose rows fit M tiles of 64.
            max_group_q=min(size, GRAPH_GROUP_ROWS),
        )

    def padded_size(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def run(
        self,
        order: list[ScheduledSeq],
        groups: list[range],
        before_replay: Callable[[StepInputs], None] | None = None,
    ) -> tuple[StepInputs, torch.Tensor]:
        """Replays the graph for this decode batch; returns its inputs and logits [len(order), vocab].
        before_replay may change the filled inputs on the device first (tokens still in flight)."""
        size = self.padded_size(len(order))
        assert size is not None, "batch larger than the largest captured graph"
        self._last = (size, bool(groups))  # groups only exist when cascade is on
        inputs = self._fill(order, groups, *self._last)
        if before_replay is not None:
            before_replay(inputs)
        return inputs, self.replay_last()[: len(order)]

    @property
    def last_key(self) -> tuple[int, bool] | None:
        """(padded size, cascade) of the last graph run: what a tensor-parallel follower replays."""
        return self._last

    def replay(self, key: tuple[int, bool]) -> torch.Tensor:
        """Replays graph `key` on the arena as it is now (a follower's step, its inputs broadcast)."""
        self._last = key
        return self.replay_last()

    def replay_last(self) -> torch.Tensor:
        """Replays the graph of the last `run` on the arena as it is now (the next step of a window)."""
        assert self._last is not None
        graph, logits = self._graphs[self._last]
        graph.replay()
        return logits
