"""How a worker places groups by the prefixes it holds (prefix-affine leasing: the Redis side is
jobs/redis_store/affinity.py). The settings loader fills it from flags and PREFIXGROVE_* variables,
beside WorkerSettings and EngineSettings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixgrove.settings import HELP, positive


@dataclass(frozen=True)
class AffinitySettings:
    prefix_affinity: bool = field(
        default=True,
        metadata={HELP: "true: lease first the groups sent here for a prefix this worker holds, "
                  "and send a new group whose prefix another live worker holds to that worker; "
                  "false: lease in queue order"},
    )  # fmt: skip
    affinity_wait_s: float = field(
        default=5.0,
        metadata={HELP: "how long a group sent to the worker holding its prefix waits for it "
                  "before any worker may take it (cut to half of --lease-timeout-s)"},
    )  # fmt: skip
    affinity_prefixes: int = field(
        default=256,
        metadata={HELP: "group prefixes a worker advertises at most (those it leased last)"},
    )
    affinity_backlog: int = field(
        default=64,
        metadata={HELP: "groups sent to one worker and not taken by it yet, at most; a group "
                  "past it is leased by the worker that read it"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        positive(self, "affinity_wait_s", "affinity_prefixes", "affinity_backlog")

    def wait_s(self, lease_timeout_s: float) -> float:
        """The wait a worker keeps to: affinity_wait_s, cut to half the lease timeout. A group sent
        to a worker starts that much short of the lease timeout's idle time, and a lease kept alive
        every third of the timeout must never look as idle as a group sent and waiting."""
        return min(self.affinity_wait_s, lease_timeout_s / 2)
