"""The note of the request a worker runs alone, kept in its group's hash (schema.py's layout), so
that the worker taking the group over after a death knows whom to blame (worker/isolation_policy.py)."""

from __future__ import annotations

from dataclasses import dataclass

from prefixgrove.jobs.redis_store.schema import text


def alone_field(group_id: str) -> str:
    """The group hash's field that holds the group's note."""
    return f"{group_id}:alone"


@dataclass(frozen=True)
class AloneNote:
    """A request of the group running alone: its line index, the group's delivery it ran in, at
    how many earlier deaths it was the one running alone (its strikes), and how many of the
    group's failed deliveries caught a request running alone (blamed on it, not on the group)."""

    index: int
    delivery: int
    strikes: int = 0
    blamed: int = 0

    def encode(self) -> str:
        return f"{self.index}:{self.delivery}:{self.strikes}:{self.blamed}"

    @classmethod
    def decode(cls, raw: bytes | str) -> AloneNote:
        index, delivery, *counts = (int(x) for x in text(raw).split(":"))
        return cls(index, delivery, *counts[:2])  # a note from before strikes and blamed: none
