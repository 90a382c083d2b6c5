"""One constrained sequence's matcher, the output tokens it has consumed, and whether its constraint
still holds.

A matcher that fails (it refuses a token, runs past one of llguidance's limits, or cannot be built)
fails the state for good, with llguidance's message: nothing is masked for it any more, and the
output processor ends its request with finish_reason "error" at the next token it takes in, never
letting it decode on unconstrained. At its end a request's output is checked once more
(`GrammarState.settle`): every token consumed, and an output ended by EOS complete.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import llguidance
import numpy as np

logger = logging.getLogger(__name__)


@dataclass
class GrammarState:
    """A sequence's matcher and the output tokens it has consumed (it may run ahead of the tokens the
    host has taken in, never behind what a step samples after)."""

    # builds the matcher (the costly part) when its first mask needs it, or ahead while the host waits
    # for the device (StepMasker.build_ahead); not as the request is taken in, where a job of
    # thousands would wait seconds for all of them before its first step
    new_matcher: Callable[[], llguidance.LLMatcher]
    eos_token_ids: frozenset[int]
    matcher_vocab: int  # token ids the matcher's masks cover
    constraint: str = "structured_outputs"  # what error messages name: structured_outputs.<kind>
    tokens: list[int] = field(default_factory=list)  # consumed, in order
    ended: bool = False  # EOS consumed, aborted, or failed: nothing is masked any more
    # why the constraint can no longer be enforced (set once, by `fail`); the request then ends
    # with finish_reason "error"
    error: str | None = None
    # (output index, token) where the last mask built for it allowed that one token alone: what the
    # step sampling that index samples, whatever its logits (jump-forward starts there)
    only_token: tuple[int, int] | None = None
    # (tokens consumed, the matcher's bits then): a mask filled before the step that needs it (the
    # token after a jump-forward run, filled to learn that it is not forced, or a first mask filled
    # ahead); that step's mask, while the matcher stays there
    next_bits: tuple[int, np.ndarray] | None = None
    masked: bool = False  # a step has masked it (a first mask filled ahead would come too late)
    _matcher: llguidance.LLMatcher | None = None

    @property
    def matcher(self) -> llguidance.LLMatcher:
        self.build()
        if self._matcher is None:
            raise RuntimeError(f"{self.constraint} has no matcher: {self.error}")
        return self._matcher

    @property
    def built(self) -> bool:
        return self._matcher is not None

    def build(self) -> None:
        """Builds the matcher, if not built yet (on any one thread: it holds no GIL meanwhile). A
        build that fails fails the state, not the step the other rows share."""
        if self._matcher is not None or self.error is not None:
            return
        try:
            self._matcher = self.new_matcher()
        except ValueError as e:
            self.fail(f"its matcher could not be built: {e}")

    @property
    def consumed(self) -> int:
        return len(self.tokens)

    def consume(self, token: int) -> None:
        if self.take(token) and not self.matcher.consume_token(token):
            self.refused(token)

    def take(self, token: int) -> bool:
        """Counts `token` as consumed; whether the matcher itself must still consume it (not once
        the state has ended, nor for an EOS that ends a complete output)."""
        self.tokens.append(token)
        if self.ended:
            return False
        if token in self.eos_token_ids and self.matcher.is_accepting():
            self.ended = True  # any of the model's EOS ids ends a complete output
            return False
        return True

    def refused(self, token: int) -> None:
        """The matcher refused `token` (the consumed-th output token): a token the step masked gets
        here only where something else decided the row (a sampling setting that allows no token
        the grammar does), or where the matcher ran past one of its limits."""
        self.fail(f"its matcher failed on token {token}: {self.matcher_error()}")

    def check_matcher(self) -> None:
        """Fails the state if its matcher has failed meanwhile (filling a mask may fail it: it
        then allows EOS alone, which would end the output as if complete)."""
        if self.error is None and self._matcher is not None and self._matcher.is_error():
            self.fail(self.matcher_error())

    def matcher_error(self) -> str:
        """llguidance's reason, its first line (the rest is its parser's state)."""
        lines = self.matcher.get_error().strip().splitlines()
        return lines[0] if lines else "the grammar matcher failed"

    def fail(self, reason: str) -> None:
        """Ends the state for good. The message names no output position: where a failure shows
        (consuming a token, or filling the mask after it) depends on the steps the batch ran in,
        and a request's error line is the same bytes on every path."""
        if self.error is not None:
            return
        self.error = f"{self.constraint} could not be enforced: {reason}"
        self.ended = True
        logger.warning("%s (after %d output tokens); its request ends with finish_reason 'error'",
                       self.error, self.consumed)  # fmt: skip

    @property
    def constrains(self) -> bool:
        if self.ended:
            return False
        self.check_matcher()
        return self.error is None

    def settle(self, output: Seq[int]) -> None:
        """At its request's end: the matcher consumes the output tokens it has not yet (the last
        ones are sampled after its last mask), and an output that ends with an EOS must have
        completed the constraint (the matcher accepted that EOS). Otherwise the state fails: an
        output is never reported as holding to a constraint that refused it."""
        if self.error is not None:
            return
        for token in output[self.consumed :]:
            self.consume(token)
        if output and output[-1] in self.eos_token_ids and not self.ended:
            self.fail("the output ended before it was complete")
