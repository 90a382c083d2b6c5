"""How much work a worker leases: enough to fill its engine's batch (requests) and KV cache (tokens),
plus a little queued ahead so that the next groups are ready when running ones finish, and no more.

Leasing by what the engine can hold, not by a count of groups, keeps a GPU full whatever a group's
size: 8 groups of 16 requests fill a quarter of a 512-request batch, 8 groups of 500 overflow it. Not
leasing beyond it keeps the rest of the queue for other workers (two workers on one job finish
together) and bounds what a dying worker leaves to be taken over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Groups asked for before any was seen: one, whose size then tells how many more fit.
_FIRST_ASK = 1
# Most groups one lease call asks for: their records are read on the engine's thread.
_MAX_ASK = 64


@dataclass(frozen=True)
class Capacity:
    """What the engine runs at once."""

    requests: int  # max_num_seqs
    kv_tokens: int  # tokens its KV cache holds


@dataclass(frozen=True)
class Held:
    """What the worker holds and has not answered yet."""

    groups: int
    requests: int
    kv_tokens: int  # prefixes once, plus each request's own prompt tokens and tokens to generate


class LeaseBudget:
    def __init__(self, capacity: Capacity, ahead: float, max_groups: int = 0) -> None:
        """`ahead`: the fraction of the engine's capacity leased beyond what it runs at once;
        `max_groups` > 0 caps the groups held whatever their size."""
        self.capacity = capacity
        self.ahead = ahead
        self.max_groups = max_groups
        self._seen_groups = 0
        self._seen_requests = 0
        self._seen_kv_tokens = 0

    def observe(self, requests: int, kv_tokens: int) -> None:
        """A group leased: its size teaches how many groups the room left holds."""
        self._seen_groups += 1
        self._seen_requests += requests
        self._seen_kv_tokens += kv_tokens

    def groups_to_ask(self, held: Held) -> int:
        """How many more groups to lease now; 0 while the engine has enough."""
        scale = 1.0 + self.ahead
        room_requests = self.capacity.requests * scale - held.requests
        room_tokens = self.capacity.kv_tokens * scale - held.kv_tokens
        if room_requests <= 0 or room_tokens <= 0:
            return 0
        if self._seen_groups == 0:
            ask = _FIRST_ASK
        else:
            per_group_requests = max(self._seen_requests / self._seen_groups, 1.0)
            per_group_tokens = max(self._seen_kv_tokens / self._seen_groups, 1.0)
            fits = min(room_requests / per_group_requests, room_tokens / per_group_tokens)
            ask = max(1, math.floor(fits))  # one more group may overshoot: never starve
        if self.max_groups > 0:
            ask = min(ask, self.max_groups - held.groups)
        return max(0, min(ask, _MAX_ASK))
