"""Redis clients of the planner and the workers: commands retry while Redis restarts."""

from __future__ import annotations

import threading
from typing import Any

import redis
from redis.backoff import AbstractBackoff, ExponentialBackoff
from redis.retry import Retry


class _StoppableBackoff(AbstractBackoff):
    """Backoff that ends the retries at once when `give_up` is set (a process shutting down)."""

    def __init__(self, inner: AbstractBackoff, give_up: threading.Event) -> None:
        self.inner = inner
        self.give_up = give_up

    def reset(self) -> None:
        self.inner.reset()

    def compute(self, failures: int) -> float:
        # Waits here rather than in Retry's sleep, so that give_up cuts the wait short.
        if self.give_up.wait(self.inner.compute(failures)):
            raise redis.ConnectionError("stopped waiting for Redis: shutting down")
        return 0.0

    def __deepcopy__(self, memo: dict[int, Any]) -> _StoppableBackoff:
        return self  # redis-py copies its Retry per connection; the event must stay shared


def connect(url: str, *, retries: int = 30, give_up: threading.Event | None = None) -> redis.Redis:
    """A client that rides out a restarting Redis: each command retries with backoff (~1 min),
    unless `give_up` is set, which ends the retrying of every command."""
    backoff: AbstractBackoff = ExponentialBackoff(cap=2.0, base=0.05)
    if give_up is not None:
        backoff = _StoppableBackoff(backoff, give_up)
    retry = Retry(backoff, retries)
    client = redis.Redis.from_url(
        url,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError],
        health_check_interval=10,
        socket_connect_timeout=5,
    )
    return client
