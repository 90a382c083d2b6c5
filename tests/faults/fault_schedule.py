"""When the campaign kills what: a seeded plan of kills, each fired once the job's answered
share reaches its mark, or, for an `upload` kill (of the planner replica taking the upload), once
that share of the input's lines is handed to the client. Marks by progress rather than by clock land
every kill while the job runs, however fast this machine is, and a seed gives the same plan on
every machine."""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("upload", "worker", "planner", "redis")
# how long each kind stays down, in seconds (uniform between the two)
DOWN_S = {"upload": (1.0, 4.0), "worker": (1.0, 4.0), "planner": (1.0, 4.0), "redis": (0.5, 2.0)}
FIRST_MARK, LAST_MARK = 0.05, 0.85  # share of requests answered


@dataclass(frozen=True)
class Kill:
    kind: str
    mark: float  # fires once this share of the job's requests is answered (of its lines sent)
    target: int  # which worker or planner replica (0 for Redis and for the upload's replica)
    down_s: float


def plan_kills(seed: int, counts: dict[str, int], replicas: dict[str, int]) -> list[Kill]:
    """`counts[kind]` kills of each kind at seeded marks, in the order they fire; `replicas[kind]`
    is how many workers or planners there are to pick from."""
    rng = random.Random(seed)
    kills = []
    for kind in KINDS:
        for _ in range(counts.get(kind, 0)):
            low, high = DOWN_S[kind]
            target = rng.randrange(replicas.get(kind, 1))  # an upload is taken by replica 0
            mark = rng.uniform(FIRST_MARK, LAST_MARK)
            kills.append(Kill(kind, round(mark, 3), target, round(rng.uniform(low, high), 2)))
    return sorted(kills, key=lambda k: k.mark)
