"""Decode windows: several decode steps of one decode-only batch per CPU round trip.

The runner enqueues a window's steps back to back (`ModelRunner.start_window`: each step's sampled
tokens become the next step's inputs on the device) and hands each step's tokens back as its copy
lands (`ModelRunner.window_results`). Here: how many steps a batch gets (its blocks for all of them
reserved), and the launch of a batch as one step or as a window, for the other ways to share.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..core.scheduler import Scheduler, SchedulerOutput
from ..core.sequence import ScheduledSeq, Sequence
from ..runner.in_flight import DecodeWindow, InFlight, StepResult
from ..runner.model_runner import ModelRunner


class DecodeWindows:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, num_scheduler_steps: int) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.num_scheduler_steps = num_scheduler_steps

    def size(self, out: SchedulerOutput) -> int:
        """How many decode steps to run before the CPU looks again (1 unless the batch is decode-only)."""
        steps = self.num_scheduler_steps
        if steps == 1 or not out.is_decode_only:
            return 1
        seqs = [item.seq for item in out.batch]
        if any(s.params.needs_output_tokens or s.num_generated < s.params.min_tokens for s in seqs):
            return 1  # their logits change with every token: the host builds each step's
        steps = min(steps, max(_tokens_left(s) for s in seqs))
        return steps if steps > 1 and self.scheduler.reserve_ahead(seqs, steps) else 1

    def run(self, batch: list[ScheduledSeq], steps: int) -> Iterator[StepResult]:
        """Runs `batch` for `steps` (1: one step) and hands back each step's rows as they land."""
        if steps == 1:
            return iter([self.runner.execute(batch)])
        return self.runner.window_results(self.runner.start_window(batch, steps))

    def launch(self, batch: list[ScheduledSeq], steps: int, feed: InFlight | None) -> InFlight:
        """Enqueues `batch` for `steps` behind `feed`, the work in flight, without waiting."""
        if steps == 1:
            return self.runner.launch(batch, feed=feed)
        return self.runner.start_window(batch, steps, feed=feed)

    def results(self, flight: InFlight) -> Iterator[StepResult]:
        """Each step's rows of work launched ahead, as they land."""
        if isinstance(flight, DecodeWindow):
            return self.runner.window_results(flight)
        return iter([self.runner.result(flight)])


def _tokens_left(seq: Sequence) -> int:
    """Tokens a request may still produce (those on their way count as produced). max_tokens binds
    before max_model_len: validation keeps prompt + max_tokens within it."""
    return seq.max_tokens - seq.num_generated
