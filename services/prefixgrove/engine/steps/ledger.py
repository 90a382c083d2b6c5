"""What every way of running a step records: tokens computed, step time, requests finished."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.in_flight_tokens import InFlightTokens
from ..core.metrics import EngineMetrics
from ..core.scheduler import Scheduler, SchedulerOutput
from ..core.sequence import ScheduledSeq, Sequence
from ..sampling.output_processor import OutputProcessor
from ..sampling.outputs import RequestOutput

if TYPE_CHECKING:
    from .windows import DecodeWindows


class StepLedger:
    def __init__(
        self,
        scheduler: Scheduler,
        output_processor: OutputProcessor,
        metrics: EngineMetrics,
        requests: dict[str, Sequence],
    ) -> None:
        self.scheduler = scheduler
        self.output_processor = output_processor
        self.metrics = metrics
        self.requests = requests  # the engine's requests by id; a finished one leaves it

    def count(self, item: ScheduledSeq) -> None:
        """The tokens `item` computes: a decode token, or prompt (and recomputed) tokens."""
        seq = item.seq
        if item.num_tokens == 1 and seq.is_decoding:
            self.metrics.decode_tokens += 1
        else:
            self.metrics.prefill_tokens += item.num_tokens

    def time_step(self, out: SchedulerOutput, steps: int, seconds: float) -> None:
        m = self.metrics
        m.steps += steps
        if out.is_decode_only:
            m.decode_steps += steps
            m.decode_seconds += seconds
            m.decode_kv_tokens += steps * sum(item.seq.num_computed_tokens for item in out.batch)
        else:
            m.mixed_seconds += seconds

    def finish(self, finished: list[Sequence]) -> list[RequestOutput]:
        """Ends the requests that just finished: blocks back, out of the engine, their outputs."""
        outputs = []
        for seq in finished:
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)
            self.metrics.requests_finished += 1
            outputs.append(self.output_processor.output(seq))
        return outputs


@dataclass(frozen=True)
class StepParts:
    """What every way of running a step works with: one ledger and one writer of in-flight counts,
    shared by all of them."""

    windows: DecodeWindows
    scheduler: Scheduler
    output_processor: OutputProcessor
    ledger: StepLedger
    metrics: EngineMetrics
    tokens: InFlightTokens
