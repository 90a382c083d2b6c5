"""A worker while Redis refuses its writes for lack of memory (OOM: `maxmemory` reached under the
`noeviction` policy). It never stops for it: it keeps the results it holds (written once Redis takes
them, first write wins) and the groups it leased (their leases kept alive: that takes no memory),
takes no new groups, and tries again after a pause that doubles up to MAX_PAUSE_S. It says so in a
log line when it starts, every minute while it lasts and when it ends, in the metrics
(`prefixgrove_worker_redis_out_of_memory`, `..._redis_refusals_total`) and on the metrics port's
/ready (503).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prefixgrove.jobs.redis_store.connection import Redis
from prefixgrove.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)
FIRST_PAUSE_S = 0.5
MAX_PAUSE_S = 8.0
_REMIND_S = 60.0


class RedisFull:
    """`wait(seconds)` pauses the worker (and may end early when it stops)."""

    def __init__(
        self,
        metrics: WorkerMetrics,
        wait: Callable[[float], Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.wait = wait
        self.clock = clock
        self.since: float | None = None  # when Redis first refused, this time round
        self._pause = FIRST_PAUSE_S
        self._reminded = 0.0

    @property
    def full(self) -> bool:
        return self.since is not None

    def refused(self, exc: Exception, holding: str) -> None:
        """A write was refused for lack of memory: says so, then waits before the next try.
        `holding`: what the worker keeps meanwhile, in words."""
        now = self.clock()
        self.metrics.redis_refusals.inc()
        if self.since is None:
            self.since = self._reminded = now
            self.metrics.redis_out_of_memory.set(1)
            self.metrics.not_ready = f"redis refuses writes, out of memory: {exc}"
            log.warning("redis refuses writes, out of memory (%s): keeping %s and taking no new "
                        "groups until Redis takes writes again (raise its maxmemory, or free "
                        "memory)", exc, holding)  # fmt: skip
        elif now - self._reminded >= _REMIND_S:
            self._reminded = now
            log.warning("redis has refused writes for %.0f s, out of memory: keeping %s",
                        now - self.since, holding)  # fmt: skip
        self.wait(self._pause)
        self._pause = min(self._pause * 2, MAX_PAUSE_S)

    def went_through(self, has_room: Callable[[], bool]) -> None:
        """An iteration of the loop went through: while Redis was full, it has room again when
        `has_room()` says so (the iteration may have written nothing), else the worker waits."""
        if self.since is None:
            return
        if not has_room():
            self.wait(self._pause)
            self._pause = min(self._pause * 2, MAX_PAUSE_S)
            return
        log.warning("redis takes writes again after %.0f s out of memory",
                    self.clock() - self.since)  # fmt: skip
        self.since = None
        self._pause = FIRST_PAUSE_S
        self.metrics.redis_out_of_memory.set(0)
        self.metrics.not_ready = ""


def has_room(client: Redis) -> bool:
    """Whether Redis (each node of a cluster) is under its maxmemory, or has none."""
    info: Any = client.info("memory")
    nodes = info.values() if all(isinstance(v, dict) for v in info.values()) else [info]
    return all(
        int(node.get("maxmemory", 0)) == 0
        or int(node.get("used_memory", 0)) < int(node["maxmemory"])
        for node in nodes
    )
