"""The engine loop: requests and groups in, one scheduled step at a time, finished requests out.

Intake (checking, groups, new sequences) is `intake.py`'s; each way of running a scheduled batch is
a module of `engine/steps/`: plain steps, decode windows, running ahead of the GPU, jump-forward.
`step()` schedules a batch and chooses the way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

from prefixgrove.catalog.generation import generation_eos_token_ids
from prefixgrove.catalog.presets import load_tokenizer

from ..config import EngineConfig
from ..parallel.launch import start_runner
from ..sampling.output_processor import OutputProcessor
from ..sampling.outputs import RequestOutput
from ..steps.ahead import AheadSteps
from ..steps.jump_forward import JumpForward
from ..steps.ledger import StepLedger, StepParts
from ..steps.plain import PlainSteps
from ..steps.windows import DecodeWindows
from ..structured.grammars import GrammarCompiler
from .block_manager import BlockManager
from .in_flight_tokens import InFlightTokens
from .intake import Intake
from .metrics import EngineMetrics
from .scheduler import Scheduler, SchedulerOutput
from .sequence import SeqStatus


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        arch = config.model.arch
        self.tokenizer = (
            None
            if config.skip_tokenizer_init
            else load_tokenizer(config.model.model, config.tokenizer)
        )
        self.runner, self.followers = start_runner(config)
        num_blocks = self.runner.num_blocks_to_allocate()
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_graphs()
        self.blocks = BlockManager(num_blocks, config.cache.block_size)
        self.scheduler = Scheduler(
            config.scheduler, self.blocks, prefix_caching=config.enable_prefix_caching
        )
        self.output_processor = OutputProcessor(
            self.tokenizer,
            arch,
            config.model.max_model_len,
            generation_eos_token_ids(config.model.model),
        )
        self.grammars = GrammarCompiler(
            self.tokenizer, arch.vocab_size, self.output_processor.eos_token_ids
        )
        self.metrics = EngineMetrics()
        self.intake = Intake(
            config,
            tokenizer=self.tokenizer,
            eos_token_ids=self.output_processor.eos_token_ids,
            grammars=self.grammars,
            blocks=self.blocks,
            scheduler=self.scheduler,
            runner=self.runner,
            metrics=self.metrics,
        )
        # Taking requests in is the intake's job: its methods are the engine's (intake.py).
        self.prepare = self.intake.prepare
        self.validate = self.intake.validate
        self.add_request = self.intake.add_request
        self.add_group = self.intake.add_group
        self._build_steps()
        # Requests that finished outside a step (an abort waits for the work in flight), for the
        # next step to return.
        self._ready: list[RequestOutput] = []

    def _build_steps(self) -> None:
        """The ways of running a step; they share one ledger and one writer of in-flight counts."""
        s, scheduler, outputs = self.config.scheduler, self.scheduler, self.output_processor
        self.windows = DecodeWindows(self.runner, scheduler, s.num_scheduler_steps)
        ledger = StepLedger(scheduler, outputs, self.metrics, self.intake.requests)
        parts = StepParts(self.windows, scheduler, outputs, ledger, self.metrics, InFlightTokens())
        self.plain = PlainSteps(parts)
        self.ahead = AheadSteps(parts, s)
        self.jump_forward = JumpForward(parts, s, self.runner)

    def abort(self, request_ids: Seq[str]) -> None:
        flight = self.ahead.take()
        if flight is not None:  # take its tokens in first; the aborted requests' are dropped
            self._ready += self.ahead.finish(flight)
        dropped = self.intake.abort(request_ids)
        if dropped:
            self._ready = [out for out in self._ready if out.request_id not in dropped]

    def reset_prefix_cache(self) -> None:
        """Forgets what the prefix cache holds (vLLM's reset_prefix_cache): the next requests start
        cold, as a benchmark's timed job must after a warm-up on its own prompts."""
        self.blocks.reset_cache()

    def has_unfinished_requests(self) -> bool:
        return self.ahead.flight is not None or bool(self._ready) or self.scheduler.has_unfinished()

    # -- one step ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step, or a window of decode steps; returns the requests that finished.
        With async scheduling the step (or window) is enqueued behind the one before, whose tokens
        this call then takes in: a request finishes in the call after the one that ran its last step."""
        ready, self._ready = self._ready, []
        return self.intake.sample_sets.collect(ready + self._step())

    def _step(self) -> list[RequestOutput]:
        """Schedules a batch and runs it ahead of the GPU where it may go ahead, else as a plain
        step or window once the work in flight is taken in; then jumps forward."""
        begin = time.perf_counter()
        preemptions = self.scheduler.num_preemptions
        out = self._schedule()
        preempted = self.scheduler.num_preemptions != preemptions
        flight = self.ahead.take()
        if out.batch and self.ahead.may_go_ahead(out, preempted):
            return self.ahead.launch(out, flight, begin) + self.jump_forward.after(out)
        outputs: list[RequestOutput] = []
        if flight is not None:
            waited = time.perf_counter()
            outputs = self.ahead.finish(flight)
            begin += time.perf_counter() - waited  # step time, not host time
        if outputs:  # the tokens just seen ended some of the batch scheduled beside them
            batch = [item for item in out.batch if item.seq.finish_reason is None]
            out = SchedulerOutput(batch)
        if not out.batch:
            self.metrics.host_seconds += time.perf_counter() - begin
            return outputs
        steps = self.windows.size(out)
        return outputs + self.plain.run(out, steps, begin) + self.jump_forward.after(out)

    def _schedule(self) -> SchedulerOutput:
        """The next batch, each of its requests stamped; what scheduling reused or preempted counted."""
        reused = self.scheduler.num_tokens_reused, self.scheduler.num_blocks_reused
        out = self.scheduler.schedule()
        now = time.time()
        for item in out.batch:
            item.seq.metrics.scheduled(now)
        self.metrics.preemptions = self.scheduler.num_preemptions
        # added, not assigned: a benchmark zeroes the metrics after its warm-up
        self.metrics.prefix_tokens_reused += self.scheduler.num_tokens_reused - reused[0]
        self.metrics.kv_blocks_shared += self.scheduler.num_blocks_reused - reused[1]
        return out

    # -- what it holds now (read-only; the worker's gauges) ---------------------------------------------

    def kv_cache_usage(self) -> float:
        """The share of the usable KV blocks that requests hold now (cached blocks nobody holds are
        free: they are taken back when needed)."""
        return (self.blocks.num_usable - self.blocks.num_free) / self.blocks.num_usable

    def num_running_requests(self) -> int:
        """Sequences in the running batch: a request of n samples counts n, a group's prefix none."""
        return sum(1 for seq in self.scheduler.running if not seq.is_prefix)

    def num_waiting_requests(self) -> int:
        """Sequences queued and not running (preempted ones included), counted as in
        `num_running_requests`."""
        requests = self.intake.requests.values()
        return sum(1 for seq in requests if seq.status is SeqStatus.WAITING)

    def close(self) -> None:
        """Stops the engine's other ranks, if it spans devices (at exit otherwise)."""
        if self.followers is not None:
            self.followers.close()  # the runner's decode graphs first, then the group
