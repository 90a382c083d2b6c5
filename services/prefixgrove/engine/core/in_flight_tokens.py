"""The one writer of a request's in-flight counts: tokens sampled on the device whose ids the host
has not seen yet.

`Sequence.num_pending_tokens` and `Sequence.num_resolved_in_flight` are data on the request, read
wherever its length matters (`num_tokens`, `num_generated`, the runner's inputs and masks); they
change only here, as a token is launched ahead of the host, lands, or is appended early by
jump-forward.
"""

from __future__ import annotations

from .sequence import Sequence


class InFlightTokens:
    """A request's tokens in flight, from launch to landing.

    - `launched`: a step enqueued before the host saw the tokens before it sampled one more token
      for the request: it counts as produced, and its id reaches the next step's inputs on the
      device.
    - `resolved`: jump-forward appended the tokens in flight already (its grammar forced each):
      they stop counting as pending, and their rows are passed over as they land.
    - `landed`: a row of work launched ahead came back for the request.
    """

    def launched(self, seq: Sequence) -> None:
        seq.num_pending_tokens += 1

    def landed(self, seq: Sequence) -> bool:
        """Whether the host is to append the row that just landed for `seq` (False: jump-forward
        appended that token already, and the row is passed over)."""
        if seq.num_resolved_in_flight:
            seq.num_resolved_in_flight -= 1
            return False
        seq.num_pending_tokens -= 1
        return True

    def resolved(self, seq: Sequence) -> None:
        """Jump-forward appends `seq`'s tokens in flight now."""
        seq.num_resolved_in_flight += seq.num_pending_tokens
        seq.num_pending_tokens = 0

    @staticmethod
    def awaits_last_token(seq: Sequence) -> bool:
        """Its last token (max_tokens) is sampled and on its way: nothing more to compute for it."""
        return seq.num_pending_tokens > 0 and seq.num_generated >= seq.max_tokens
