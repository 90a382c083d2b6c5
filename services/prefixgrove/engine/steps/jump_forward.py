"""Jump-forward for structured outputs: where a request's grammar allows one token alone, and the
tokens after it are each the one its grammar allows, the host appends them at once; the next step
computes them as one chunk and samples after them, instead of a step each.

The output is what step-by-step decoding gives: a forced token is sampled whatever the logits, and a
seeded draw depends on its output index, not on the step. A step still in flight samples the run's
first token (and, for a window, tokens the host waited for to build the masks): the host appends
those too, and passes their rows over as they land (`InFlightTokens.resolved`). Not for requests
asking for logprobs (a skipped step has no logits).
"""

from __future__ import annotations

from ..config import SchedulerConfig
from ..core.scheduler import SchedulerOutput
from ..core.sequence import Sequence
from ..runner.model_runner import ModelRunner
from ..sampling.outputs import RequestOutput
from .ledger import StepParts


class JumpForward:
    def __init__(self, parts: StepParts, config: SchedulerConfig, runner: ModelRunner) -> None:
        self.enabled = config.jump_forward
        self.in_windows = config.num_scheduler_steps > 1
        self.runner = runner  # its masker (looked up each step: a test swaps it)
        self.scheduler, self.ledger, self.metrics = parts.scheduler, parts.ledger, parts.metrics
        self.output_processor, self.tokens = parts.output_processor, parts.tokens

    def after(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Jumps forward over the forced runs of the constrained requests `out` just sampled;
        returns the requests a run finished. Runs already appended are computed by the next step.

        Not where steps run in windows and the next would compute output tokens alone (every
        prompt computed, or every seat taken by requests that have sampled): a run's chunk would
        make that step a mixed one, run without a CUDA graph and with the host's work for it each
        step, where the same tokens decode in windows of steps with no round trip (the structured
        job of benchmarks/RESULTS.md measures both). A step that admits requests is mixed anyway:
        there runs ride along."""
        if not self.enabled:
            return []
        masker = self.runner.masker
        if self.in_windows and self.scheduler.only_outputs_next:
            masker.forget_recent()
            return []
        masker.note_only_tokens()
        starts = self._starts(out)
        if not starts:
            return []
        runs = masker.forced_runs(
            [(seq.grammar, seq.max_tokens - seq.num_generated + 1) for seq in starts]  # type: ignore[misc]
        )
        return self.ledger.finish(self._append_runs(starts, runs))

    def _starts(self, out: SchedulerOutput) -> list[Sequence]:
        """The requests whose mask of the token they sampled last allowed that token alone."""
        starts: list[Sequence] = []
        for item in out.batch:
            seq, state = item.seq, item.seq.grammar
            if state is None or state.only_token is None:
                continue
            index = state.only_token[0]
            if (
                seq.finished
                or seq.params.logprobs is not None
                or index != seq.num_generated - 1  # not the token it sampled last
                or index != state.consumed
            ):
                state.only_token = None
                continue
            starts.append(seq)
        return starts

    def _append_runs(self, starts: list[Sequence], runs: list[list[int]]) -> list[Sequence]:
        """Appends each request's forced run past the token it sampled; the requests it finished."""
        finished: list[Sequence] = []
        for seq, run in zip(starts, runs, strict=True):
            if self.output_processor.constraint_failed(seq):
                finished.append(seq)  # its matcher failed on the run: it ends now, as an error
                continue
            if len(run) < 2:
                continue  # nothing forced beyond the token the step samples anyway
            assert seq.grammar is not None
            known = len(seq.output_token_ids)
            self.tokens.resolved(seq)
            self.metrics.tokens_jumped += len(run) - 1
            for token in seq.grammar.tokens[known:]:
                if self.output_processor.append_known(seq, token):
                    finished.append(seq)
                    break
        return finished
