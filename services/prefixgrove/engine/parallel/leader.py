"""Rank 0's end of the followers' command pipes.

What each step runs goes to every follower as a small pickled message (its shape, the graph it
replays, the prompt rows it scores); the step's inputs follow in one collective broadcast of the
arena. The pipe, not a collective, carries the wait between steps: an idle engine may wait for work
for hours, longer than any collective's timeout should be.
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing.connection import Connection


class FollowerLink:
    def __init__(self, connections: list[Connection]) -> None:
        self.connections = connections
        # Called with the follower's rank when its pipe breaks: it is exiting, and its pipe may say
        # so a moment before its process can be reaped (launch.Followers ends the engine, naming it)
        self.on_lost: Callable[[int, BaseException], None] | None = None

    def send(self, op: str, *args: object) -> None:
        for rank, connection in enumerate(self.connections, start=1):
            try:
                connection.send((op, args))
            except OSError as error:
                if self.on_lost is not None:
                    self.on_lost(rank, error)
                raise
