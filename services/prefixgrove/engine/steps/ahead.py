"""Running ahead of the GPU (async scheduling): a batch (one step, or a window of decode steps) is
enqueued behind the work in flight before the host has seen that work's tokens, and the host then
waits for and takes in the earlier tokens while the device runs the new batch.

A request that ends while work in flight still computes a row for it (its last token is on the
way, or the tokens taken in after a launch stop it) gives its slot and blocks back at once: whatever
could reuse them is enqueued behind that work. Tokens on their way are counted on each request by
`InFlightTokens`; their ids reach the next step's inputs on the device (`ModelRunner.launch`'s
`feed`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from ..config import SchedulerConfig
from ..core.scheduler import SchedulerOutput
from ..core.sequence import ScheduledSeq, Sequence
from ..runner.in_flight import DecodeWindow, InFlight, StepResult
from ..sampling.outputs import RequestOutput
from .ledger import StepParts


class AheadSteps:
    def __init__(self, parts: StepParts, config: SchedulerConfig) -> None:
        self.enabled = config.async_scheduling
        self.windows, self.scheduler, self.ledger = parts.windows, parts.scheduler, parts.ledger
        self.output_processor, self.metrics = parts.output_processor, parts.metrics
        self.tokens = parts.tokens
        # The step or window on the device whose tokens the host has not taken in yet.
        self.flight: InFlight | None = None

    def take(self) -> InFlight | None:
        """The work in flight, which the caller now takes in (or feeds the next launch)."""
        flight, self.flight = self.flight, None
        return flight

    def may_go_ahead(self, out: SchedulerOutput, preempted: bool) -> bool:
        """Whether `out` may be enqueued before the host has seen the tokens of the step in flight:
        nobody preempted, no penalties or bad words of several tokens (they read every output token
        on the host), and every request with a token still on its way needs only that one as an input
        (a decode row)."""
        return (
            self.enabled
            and not preempted
            and not any(item.seq.params.needs_output_tokens for item in out.batch)
            and all(item.num_tokens == 1 for item in out.batch if item.seq.num_pending_tokens)
        )

    def launch(
        self, out: SchedulerOutput, before: InFlight | None, begin: float
    ) -> list[RequestOutput]:
        """Enqueues `out` (a step, or a window of decode steps) behind `before`, the work in flight
        (if any), takes what it will have computed as done, then waits for and takes in `before`. So
        the GPU starts on `out` the moment it finishes what came before, while the host scheduled and
        filled `out` and then takes in the earlier tokens during it."""
        start = time.perf_counter()
        steps = self.windows.size(out)
        self.flight = self.windows.launch(out.batch, steps, feed=before)
        self._launched(out.batch, steps)
        self.metrics.steps_launched_ahead += 1
        self.ledger.time_step(out, steps, time.perf_counter() - start)
        self.metrics.host_seconds += start - begin
        return self.finish(before) if before is not None else []

    def _launched(self, batch: list[ScheduledSeq], steps: int) -> None:
        """The batch's chunks taken as computed and its tokens as sampled, for every step."""
        count, complete_chunk = self.ledger.count, self.scheduler.complete_chunk
        launched = self.tokens.launched
        for _ in range(steps):
            for item in batch:
                count(item)
                complete_chunk(item)
                if item.sample:
                    launched(item.seq)
        awaits_last_token = self.tokens.awaits_last_token
        for item in batch:
            if item.sample and awaits_last_token(item.seq):
                # Nothing more runs for it: its slot and blocks go back now, as they would once the
                # host had seen that token (whatever reuses them is enqueued behind this step); it
                # finishes as usual when the token lands.
                self.scheduler.finish(item.seq)

    def finish(self, flight: InFlight) -> list[RequestOutput]:
        """Waits for work launched ahead and takes in its tokens."""
        start = time.perf_counter()
        outputs = self.ledger.finish(self._take_in(self.windows.results(flight)))
        seconds = time.perf_counter() - start
        if isinstance(flight, DecodeWindow):
            self.metrics.decode_seconds += seconds
        else:
            self.metrics.mixed_seconds += seconds
        return outputs

    def _take_in(self, results: Iterator[StepResult]) -> list[Sequence]:
        """Each landed row appended to its request; the requests they finished."""
        finished: list[Sequence] = []
        landed, append_token = self.tokens.landed, self.output_processor.append_token
        for order, rows in results:
            sampled = iter(rows)
            for item in order:
                if not item.sample:
                    continue
                row, seq = next(sampled), item.seq
                if not landed(seq):
                    continue  # jump-forward appended it already
                if seq.finish_reason is not None:
                    continue  # aborted, or stopped earlier: this token is dropped
                if append_token(seq, row):
                    finished.append(seq)
        return finished
