"""How a worker stops: it takes no new groups, finishes those it holds for at most drain_timeout_s,
then gives back what is left. With Redis gone it does not wait for it: once Redis stays unreachable
for half of stop_timeout_s, every command fails at once, and the worker exits within the timeout.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.queue import GroupQueue
from prefixgrove.settings import WorkerSettings
from prefixgrove.worker.engine_requests import EngineRequests
from prefixgrove.worker.flights import Flights

log = logging.getLogger(__name__)


class Drain:
    """Once `stop` is set, the worker takes no new groups and finishes those it holds."""

    def __init__(self, stop: threading.Event, timeout_s: float) -> None:
        self.stop = stop
        self.timeout_s = timeout_s
        self.deadline: float | None = None  # set once stopping

    @property
    def taking(self) -> bool:
        """Whether the worker may take new groups."""
        return self.deadline is None

    def over(self, holding: int) -> bool:
        """Whether the loop ends: stopping, with no groups left or out of time."""
        if self.stop.is_set() and self.deadline is None:
            self.deadline = time.monotonic() + self.timeout_s
            log.info("stopping: finishing %d groups in flight", holding)
        return self.deadline is not None and (not holding or time.monotonic() > self.deadline)


def watch_redis(
    stop: threading.Event,
    finished: threading.Event,
    settings: WorkerSettings,
    give_up: threading.Event,
) -> None:
    """Once stopping (until `finished`), a Redis that stays unreachable for half of
    stop_timeout_s is given up on: `give_up` is set, every command then fails at once instead of
    retrying for a minute, so the worker gives back what it can and exits within the timeout."""
    while not stop.wait(0.25):
        if finished.is_set():
            return
    probe = connect(settings.redis_url, retries=0, socket_timeout=1.0)
    down_since: float | None = None
    with probe:
        while not finished.wait(0.25):
            try:
                probe.ping()
                down_since = None
            except redis.RedisError:
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since >= settings.stop_timeout_s / 2:
                    log.warning("stopping with redis unreachable: giving up on it")
                    give_up.set()
                    return


def give_back(flights: Flights, running: EngineRequests, queue: GroupQueue, failed: bool) -> None:
    """Aborts every group the worker holds and gives it back to the queue, counted as a failed
    delivery when `failed` (the worker stops on an error)."""
    for flight in list(flights):
        running.drop(flight)
        queue.release(flight.lease, failed)
        flights.pop(flight.lease)
        log.info("gave back group %s of job %s", flight.lease.group_id, flight.lease.job_id)
