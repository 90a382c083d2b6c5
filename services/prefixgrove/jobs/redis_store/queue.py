"""Leasing whole groups from a model's Redis Stream.

A lease is a stream entry delivered to this worker and not yet acknowledged. A thread keeps the
leases alive (XCLAIM ... JUSTID resets their idle time); an entry left idle past the lease timeout
belonged to a worker that died, and a live one claims it (`XCLAIM`).

A group is never queued again as a new entry: its entry stays pending, so its delivery count (what
the worker's guard against a group that keeps stopping workers reads) survives every hand-back.
Giving a group back moves the entry to the `schema.GIVEN_BACK` consumer with an idle time past any
lease timeout, so the next claim takes it at once and counts one more delivery; a clean
give-back (a worker stopping) lowers the count first, so it does not count as a failure.

A group that a worker takes over with one failed delivery or more behind it is a suspect: its worker
may have died of it, or of a neighbour. The worker takes none beside other groups (`take(...,
suspects=False)` says when one waits); once it holds nothing it takes one with `take_suspect` and
runs it with nothing beside it, so that a death then counts against the suspect alone. Both read the claimable entries with
`XPENDING ... IDLE` (one round trip per take, none more) and claim the chosen ones with
`XCLAIM` under the same minimum idle time, so that two workers never both take one.

Prefix affinity (with an `affinity`, affinity.py): a worker reading a new group whose prefix another
live worker holds, and it does not, sends it there: the entry moves, still pending, to the consumer
`for:<holder>` with no delivery counted and an idle time of the lease timeout less the affinity
wait. The holder claims the groups sent to it before anything else, under a minimum idle time of
the lease timeout less the wait (a group claimed since, its idle time reset, is never taken twice);
once the wait is over the group is idle past the lease timeout and any worker takes it as it takes
a dead worker's group. Only new entries are sent, so a group is sent once and waits `wait_s` at
most, and a holder with `backlog` groups waiting for it is sent no more: no group or job starves.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import redis

from prefixgrove.jobs.redis_store import schema
from prefixgrove.jobs.redis_store.affinity import SENT_TO, PrefixAffinity, sent_to
from prefixgrove.jobs.redis_store.connection import Redis
from prefixgrove.jobs.redis_store.schema import text

log = logging.getLogger(__name__)
_GIVEN_BACK_IDLE_MS = 7 * 24 * 3600 * 1000  # idle past any lease timeout: claimable at once
_SUSPECT_SCAN = 16  # claimable entries read to find a suspect among groups given back cleanly
_MAX_SENT = 64  # new groups one take sends to other workers at most, reading more in their place


@dataclass(frozen=True)
class Lease:
    entry_id: str
    job_id: str
    group_id: str
    deliveries: int = 1
    prefix: str = ""  # the name of the group's prefix (affinity.py), "" where it has none


class GroupQueue:
    def __init__(self, client: Redis, model: str, consumer: str, lease_timeout_s: float,
                 affinity: PrefixAffinity | None = None) -> None:  # fmt: skip
        self.r = client
        self.key = schema.queue_key(model)
        self.consumer = consumer
        self.lease_timeout_ms = int(lease_timeout_s * 1000)
        self.affinity = affinity
        # a group sent to a worker starts this idle: past the lease timeout once its wait is over
        self.sent_idle_ms = self.lease_timeout_ms - int(affinity.wait_s * 1000) if affinity else 0
        self.sent = 0  # groups this worker sent to the worker holding their prefix, so far
        self._held: dict[str, Lease] = {}
        self._lost: set[str] = set()
        self._lock = threading.Lock()
        self.suspect_waiting = False  # the last take(suspects=False) left a suspect waiting

    def take(self, count: int, block_ms: int, *, suspects: bool = True) -> list[Lease]:
        """Groups sent here for a prefix this worker holds first, then those idle past the lease
        timeout (their worker died, or gave them back), then new ones, waiting up to block_ms for
        any. With `suspects=False` a suspect is left waiting, and while one waits no group at all
        is taken: `suspect_waiting` then says so, and the worker empties itself to take it with
        `take_suspect`."""
        waiting = self._claimable(count)
        self.suspect_waiting = not suspects and any(delivered for _, delivered in waiting)
        if self.suspect_waiting:
            return []
        leases = self._claim_sent(count)
        leases += self._claim([eid for eid, _ in waiting][: count - len(leases)])
        if len(leases) < count:
            block = None if leases or block_ms <= 0 else block_ms
            leases += self._read_new(count - len(leases), block)
        self._hold(leases)
        if self.affinity is not None:
            self.affinity.hold(lease.prefix for lease in leases)
        return leases

    def _read_new(self, count: int, block: int | None) -> list[Lease]:
        """Up to `count` new groups; with affinity, those whose prefix another live worker holds
        are sent to it and more are read in their place (up to _MAX_SENT a call)."""
        leases: list[Lease] = []
        sent = 0
        while len(leases) < count:
            reply: Any = self.r.xreadgroup(schema.CONSUMER_GROUP, self.consumer, {self.key: ">"},
                                           count=count - len(leases), block=block)  # fmt: skip
            read = [_lease(eid, fields) for _, entries in reply or [] for eid, fields in entries]
            kept = self._send(read) if sent < _MAX_SENT else read
            leases += kept
            sent += len(read) - len(kept)
            if len(kept) == len(read):  # none sent away: the queue had no more than this now
                break
            block = None
        return leases

    def _send(self, read: list[Lease]) -> list[Lease]:
        """Sends each group whose prefix another live worker holds to it, while fewer than the
        backlog wait for that worker; returns the groups kept."""
        if self.affinity is None:
            return read
        holders = self.affinity.holders(lease.prefix for lease in read)
        if not holders:
            return read
        waiting, kept = self._sent_waiting(), []
        pipe = self.r.pipeline(transaction=False)
        for lease in read:
            holder = holders.get(lease.prefix)
            if holder is None or waiting.get(holder, 0) >= self.affinity.backlog:
                kept.append(lease)
                continue
            waiting[holder] = waiting.get(holder, 0) + 1
            pipe.xclaim(self.key, schema.CONSUMER_GROUP, sent_to(holder), 0, [lease.entry_id],
                        idle=self.sent_idle_ms, retrycount=0, justid=True)  # fmt: skip
        pipe.execute()
        self.sent += len(read) - len(kept)
        return kept

    def _sent_waiting(self) -> dict[str, int]:
        """Per worker, the groups sent to it that it has not taken yet."""
        summary: Any = self.r.xpending(self.key, schema.CONSUMER_GROUP)
        consumers = (summary or {}).get("consumers") or []
        names = ((text(c["name"]), int(c["pending"])) for c in consumers)
        return {name.removeprefix(SENT_TO): n for name, n in names if name.startswith(SENT_TO)}

    def _claim_sent(self, count: int) -> list[Lease]:
        """The groups another worker sent here, for the prefix this one holds, that no worker took
        since their wait ended (a claim resets the idle time below the minimum asked here)."""
        if self.affinity is None or count <= 0:
            return []
        pending: Any = self.r.xpending_range(self.key, schema.CONSUMER_GROUP, "-", "+", count,
                                             consumername=sent_to(self.consumer))  # fmt: skip
        if not pending:
            return []
        ids = [p["message_id"] for p in pending]
        claimed: Any = self.r.xclaim(
            self.key, schema.CONSUMER_GROUP, self.consumer, self.sent_idle_ms, ids
        )
        return [_lease(eid, fields) for eid, fields in claimed if fields]

    def take_suspect(self) -> Lease | None:
        """The first group waiting to be taken over after a failed delivery, if another worker
        has not taken it meanwhile; the worker runs it with nothing beside it."""
        self.suspect_waiting = False  # taken now, or by another worker: lease as usual
        suspects = [eid for eid, delivered in self._claimable(_SUSPECT_SCAN) if delivered]
        leases = self._claim(suspects[:1])
        self._hold(leases)
        return leases[0] if leases else None

    def _claimable(self, count: int) -> list[tuple[str, int]]:
        """(entry id, deliveries so far) of pending entries idle past the lease timeout: their
        worker died, or gave them back."""
        pending: Any = self.r.xpending_range(
            self.key, schema.CONSUMER_GROUP, "-", "+", count, idle=self.lease_timeout_ms
        )
        return [(text(p["message_id"]), int(p["times_delivered"])) for p in pending]

    def _claim(self, entry_ids: list[Any]) -> list[Lease]:
        """Takes these entries over, those still idle past the lease timeout (another worker may
        have taken one since it was read; a deleted entry drops out of the pending list)."""
        if not entry_ids:
            return []
        claimed: Any = self.r.xclaim(
            self.key, schema.CONSUMER_GROUP, self.consumer, self.lease_timeout_ms, entry_ids
        )
        leases = []
        for eid, fields in claimed:
            if not fields:
                continue
            info = self.r.xpending_range(self.key, schema.CONSUMER_GROUP, eid, eid, 1)
            deliveries = int(info[0]["times_delivered"]) if info else 1
            lease = _lease(eid, fields, deliveries)
            log.warning("took over group %s of job %s (delivery %d)",
                        lease.group_id, lease.job_id, deliveries)  # fmt: skip
            leases.append(lease)
        return leases

    def _hold(self, leases: list[Lease]) -> None:
        with self._lock:
            for lease in leases:
                self._held[lease.entry_id] = lease

    def ack(self, lease: Lease) -> None:
        self.r.xack(self.key, schema.CONSUMER_GROUP, lease.entry_id)
        self._forget(lease)

    def release(self, lease: Lease, failed: bool) -> None:
        """Gives a group back at once, its entry still pending: the next claim takes it and
        counts a delivery. `failed=False` (a worker stopping cleanly) takes this delivery off the
        count first, so the group comes back with the count it had; a worker that fails keeps it
        counted, and the guard on deliveries sees it."""
        retries = lease.deliveries if failed else lease.deliveries - 1
        # Not a transaction: the stream and the job's leased set live in different cluster slots.
        # Stopped between the two, the group stays counted as leased until it is leased again.
        pipe = self.r.pipeline(transaction=False)
        pipe.xclaim(self.key, schema.CONSUMER_GROUP, schema.GIVEN_BACK, 0, [lease.entry_id],
                    idle=_GIVEN_BACK_IDLE_MS, retrycount=max(retries, 0), justid=True)  # fmt: skip
        pipe.srem(schema.JobKeys(lease.job_id).leased, lease.group_id)
        pipe.execute()
        self._forget(lease)

    def abandon(self, lease: Lease) -> None:
        """Stops keeping a lease alive without acknowledging it: it times out and is taken over."""
        self._forget(lease)

    def lost(self) -> list[Lease]:
        """Leases another worker took over (this one stalled past the timeout); drop their work."""
        with self._lock:
            gone = [self._held.pop(eid) for eid in self._lost if eid in self._held]
            self._lost.clear()
        return gone

    def keep_alive(self) -> None:
        """Resets the idle time of the entries this worker still owns."""
        with self._lock:
            held = list(self._held)
        if not held:
            return
        owned = {
            text(p["message_id"])  # type: ignore[arg-type]
            for p in self.r.xpending_range(
                self.key,
                schema.CONSUMER_GROUP,
                "-",
                "+",
                len(held) + 100,
                consumername=self.consumer,
            )
        }
        mine: list[Any] = [eid for eid in held if eid in owned]
        if mine:
            self.r.xclaim(self.key, schema.CONSUMER_GROUP, self.consumer, 0, mine, justid=True)
        with self._lock:
            self._lost.update(eid for eid in held if eid not in owned and eid in self._held)

    def start_keepalive(self, interval_s: float, stop: threading.Event) -> threading.Thread:
        def loop() -> None:
            while not stop.wait(interval_s):
                try:
                    self.keep_alive()
                    if self.affinity is not None:
                        self.affinity.refresh()
                except redis.RedisError as exc:  # Redis restarting: the next round retries
                    log.warning("lease keepalive failed: %s", exc)

        thread = threading.Thread(target=loop, name="lease-keepalive", daemon=True)
        thread.start()
        return thread

    def _forget(self, lease: Lease) -> None:
        with self._lock:
            self._held.pop(lease.entry_id, None)
            self._lost.discard(lease.entry_id)


def _lease(entry_id: bytes | str, fields: dict[bytes, bytes], deliveries: int = 1) -> Lease:
    prefix = text(fields.get(b"prefix", b""))
    return Lease(text(entry_id), text(fields[b"job"]), text(fields[b"group"]), deliveries, prefix)
