"""Prefix-affine leasing, what workers advertise: which worker holds which group prefixes.

A group's stream entry names its prefix (`prefix`: PrefixIndex.affinity_key, the same for the
groups of every job that share a system prompt and document). A worker that leases a group
advertises its prefix, whose KV its engine's prefix cache then keeps across leases; a worker that
reads a new group whose prefix another live worker holds, and it does not, sends the group to that
worker (queue.py says how, and how long the group waits for it).

Keys (prefix `pg:`, beside schema.py's):
  pg:holds:<model>:<consumer>  sorted set: prefix -> when the worker last leased a group of it; its
                               newest `max_prefixes` only; expires `ttl_s` after the worker's last
                               refresh, so a dead worker's advertisement goes with it
  pg:holders:<model>           sorted set: consumer -> until when its advertisement lives
Stream consumers `for:<consumer>` hold the groups sent to that worker and not taken yet.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prefixgrove.jobs.redis_store import schema
from prefixgrove.jobs.redis_store.connection import Redis
from prefixgrove.jobs.redis_store.schema import text

SENT_TO = "for:"  # the stream consumer `for:<consumer>` holds the groups sent to that worker


def holds_key(model: str, consumer: str) -> str:
    return f"{schema.PREFIX}holds:{model}:{consumer}"


def holders_key(model: str) -> str:
    return f"{schema.PREFIX}holders:{model}"


def sent_to(consumer: str) -> str:
    return SENT_TO + consumer


class PrefixAffinity:
    def __init__(self, client: Redis, model: str, consumer: str, *, ttl_s: float,
                 wait_s: float, max_prefixes: int, backlog: int) -> None:  # fmt: skip
        """`ttl_s`: how long an advertisement outlives its worker's last refresh; `wait_s`: how long
        a group sent to a worker waits for it; `backlog`: groups sent to one worker and not yet
        taken, at most."""
        self.r = client
        self.model = model
        self.consumer = consumer
        self.ttl_s = ttl_s
        self.wait_s = wait_s
        self.max_prefixes = max_prefixes
        self.backlog = backlog

    def hold(self, prefixes: Iterable[str]) -> None:
        """Advertises the prefixes of groups this worker just leased (its cache will hold them)."""
        now = time.time()
        names = {p: now for p in prefixes if p}
        if not names:
            return
        key = holds_key(self.model, self.consumer)
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(key, names)  # type: ignore[arg-type]
        pipe.zremrangebyrank(key, 0, -self.max_prefixes - 1)
        pipe.expire(key, _ttl(self.ttl_s))
        pipe.zadd(holders_key(self.model), {self.consumer: now + self.ttl_s})
        pipe.execute()

    def refresh(self) -> None:
        """Keeps this worker's advertisement alive (the lease keepalive calls it), and drops the
        holders whose own lapsed."""
        now = time.time()
        pipe = self.r.pipeline(transaction=False)
        pipe.expire(holds_key(self.model, self.consumer), _ttl(self.ttl_s))
        pipe.zadd(holders_key(self.model), {self.consumer: now + self.ttl_s})
        pipe.zremrangebyscore(holders_key(self.model), "-inf", now)
        pipe.execute()

    def withdraw(self) -> None:
        """A worker stopping: it holds nothing any more."""
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(holds_key(self.model, self.consumer))
        pipe.zrem(holders_key(self.model), self.consumer)
        pipe.execute()

    def holders(self, prefixes: Iterable[str]) -> dict[str, str]:
        """Of these prefixes, those this worker does not hold and another live worker does: prefix
        -> that worker (the one that leased a group of it last)."""
        wanted = sorted({p for p in prefixes if p})
        if not wanted:
            return {}
        live: Any = self.r.zrangebyscore(holders_key(self.model), time.time(), "+inf")
        others = [c for c in (text(c) for c in live) if c != self.consumer]
        if not others:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for consumer in [self.consumer, *others]:
            pipe.zmscore(holds_key(self.model, consumer), wanted)
        mine, *theirs = pipe.execute()
        best: dict[str, tuple[float, str]] = {}
        for consumer, scores in zip(others, theirs, strict=True):
            for prefix, score in zip(wanted, scores or [], strict=False):
                if score is not None and score > best.get(prefix, (-1.0, ""))[0]:
                    best[prefix] = (score, consumer)
        held_here = {p for p, score in zip(wanted, mine or [], strict=False) if score is not None}
        return {p: consumer for p, (_, consumer) in best.items() if p not in held_here}


def _ttl(seconds: float) -> int:
    return max(int(seconds + 0.999), 1)
