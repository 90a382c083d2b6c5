"""Rank 0's end of the followers' command pipes.

What each step runs goes to every follower as a small pickled message (its shape, the graph it
replays, the prompt rows it scores); the step's inputs follow in one collective broadcast of the
arena. The pipe, not a collective, carries the wait between steps: an idle engine may wait for work
for hours, longer than any collective's timeout should be.
"""

from __future__ import annotations

from multiprocessing.connection import Connection


class FollowerLink:
    def __init__(self, connections: list[Connection]) -> None:
        self.connections = connections

    def send(self, op: str, *args: object) -> None:
        for connection in self.connections:
            connection.send((op, args))
