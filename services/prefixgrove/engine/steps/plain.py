"""Plain steps: a batch runs (one step, or a window of decode steps) and the host waits for its
tokens, taking each in as it lands, before the next batch is scheduled."""

from __future__ import annotations

import time
from collections.abc import Iterator

from ..core.scheduler import SchedulerOutput
from ..core.sequence import Sequence
from ..runner.in_flight import StepResult
from ..sampling.outputs import RequestOutput
from .ledger import StepParts


class PlainSteps:
    def __init__(self, parts: StepParts) -> None:
        self.windows, self.scheduler, self.ledger = parts.windows, parts.scheduler, parts.ledger
        self.output_processor, self.metrics = parts.output_processor, parts.metrics

    def run(self, out: SchedulerOutput, steps: int, begin: float) -> list[RequestOutput]:
        """Runs a batch (one step, or a window of decode steps) and waits for its tokens; `begin`:
        when the host started on this step (its scheduling counts as host time)."""
        start = time.perf_counter()
        finished = self._take_in(self.windows.run(out.batch, steps))
        end = time.perf_counter()
        self.ledger.time_step(out, steps, end - start)
        outputs = self.ledger.finish(finished)
        self.metrics.host_seconds += time.perf_counter() - end + start - begin
        return outputs

    def _take_in(self, results: Iterator[StepResult]) -> list[Sequence]:
        """Each step's chunks computed and sampled tokens appended; the requests they finished."""
        finished: list[Sequence] = []
        count, complete_chunk = self.ledger.count, self.scheduler.complete_chunk
        append_token = self.output_processor.append_token
        for order, rows in results:
            sampled = iter(rows)
            for item in order:
                row = next(sampled) if item.sample else None
                if item.seq.finish_reason is not None:
                    continue  # it stopped earlier in this window; its later tokens are dropped
                count(item)
                complete_chunk(item)
                if row is not None and append_token(item.seq, row):
                    finished.append(item.seq)
        return finished
