"""When the campaign does what: a seeded plan of faults, each fired once the job's answered share
reaches its mark, or, for an `upload` kill (of the planner replica taking the upload), once that
share of the input's lines is handed to the client, and for a `resubmit` (a client killed once it
sent that share of the lines, its submit then made again under the same idempotency key) before
the job is submitted. Besides kills of workers, planners and Redis: `stall` (a client holding
uploads that send nothing and watches that read nothing, for its time) and `oom` (Redis refusing
every write that takes memory, for its time). Marks by progress rather than by clock land every
fault while the job runs, however fast this machine is, and a seed gives the same plan on every
machine."""

from __future__ import annotations

import random
from dataclasses import dataclass

# NOTE: new kinds go last: the plan draws kind by kind, so a seed keeps its plan of the others
KINDS = ("upload", "worker", "planner", "redis", "resubmit", "stall", "oom")
# how long each kind stays down (a stall lasts, Redis stays full), in seconds (uniform between the
# two); a resubmitted client stays dead
DOWN_S = {"upload": (1.0, 4.0), "worker": (1.0, 4.0), "planner": (1.0, 4.0), "redis": (0.5, 2.0),
          "resubmit": (0.0, 0.0), "stall": (5.0, 20.0), "oom": (1.0, 4.0)}  # fmt: skip
FIRST_MARK, LAST_MARK = 0.05, 0.85  # share of requests answered


@dataclass(frozen=True)
class Kill:
    kind: str
    mark: float  # fires once this share of the job's requests is answered (of its lines sent)
    target: int  # which worker or planner replica (0 for the others)
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
