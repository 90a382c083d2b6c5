"""Finding the request that makes the engine fail, without throwing back the groups beside it.

When a step raises, every request the engine held is a suspect. They are aborted and run again in
halves, one half at a time and nothing else beside it: a half that runs through is cleared (its
results are written as usual), a half that raises is halved again, and a request that raises alone
is the culprit, failed on its own. k culprits among n suspects cost about 2n + k log2(n) request runs.
A group that keeps killing whole workers is queued request by request (`queue_alone`) the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A request that raises alone right after another one did suggests that the engine itself is broken
# (every request would): after this many in a row the worker stops instead of failing them all.
MAX_CULPRITS_IN_A_ROW = 3


class EngineBroken(RuntimeError):
    """The engine raised on MAX_CULPRITS_IN_A_ROW requests alone in a row with no success between."""


@dataclass
class Isolation:
    pieces: list[list[str]] = field(default_factory=list)  # suspects still to run, next first
    testing: bool = False  # a piece runs now, with nothing beside it
    culprits_in_a_row: int = 0

    @property
    def active(self) -> bool:
        """While suspects run apart the worker takes no new groups."""
        return bool(self.pieces) or self.testing

    def failed(self, running: list[str], cause: BaseException) -> str | None:
        """The engine raised while it ran `running`: returns the culprit when it ran alone;
        otherwise queues both halves to run apart."""
        self.testing = False
        if len(running) > 1:
            half = len(running) // 2
            self.pieces[:0] = [running[:half], running[half:]]
            return None
        self.culprits_in_a_row += 1
        if self.culprits_in_a_row >= MAX_CULPRITS_IN_A_ROW:
            raise EngineBroken(
                f"the engine raised on {self.culprits_in_a_row} requests in a row, each alone; "
                f"the last: {type(cause).__name__}: {cause}"
            ) from cause
        return running[0] if running else None

    def queue_alone(self, request_ids: list[str]) -> None:
        """Requests to run one at a time, after the suspects queued before them."""
        self.pieces += [[rid] for rid in request_ids]

    def succeeded(self) -> None:
        self.culprits_in_a_row = 0

    def next_piece(self) -> list[str]:
        """The next suspects to run alone; none once the last piece ran through (isolation ends)."""
        self.testing = bool(self.pieces)
        return self.pieces.pop(0) if self.pieces else []
