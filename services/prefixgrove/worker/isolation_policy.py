"""Who runs alone, and whom a failure is blamed on.

When the engine raises, the requests it held are run apart until the one that raises is alone
(isolation.py); the other groups stay on the worker and finish.

A group taken over after a failed delivery (a suspect: its worker died, of it or of a neighbour)
runs with nothing beside it: the worker stops leasing, finishes what it holds, takes the suspect and
leases nothing else until it is done. A death then counts against the suspect alone, so a group
that shared a worker with a poison group spends one delivery on it, not all of them. A suspect
that failed two deliveries runs request by request, each alone; a request that was the one running
alone at two deaths is failed (one death may be a kill from outside, which a delivery cannot tell
from a crash). A request run apart keeps its group's prefix (a group of one), so its output is the
same bytes as in its group.

The request about to run alone is noted in Redis first (AloneNotes), so that the worker that takes
its group over after a death knows whom to blame.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from prefixgrove.jobs.redis_store.alone_note import AloneNote
from prefixgrove.jobs.redis_store.queue import Lease
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.worker.engine_requests import EngineRequests
from prefixgrove.worker.flights import Flights, GroupKey, InFlight, group_of, request_id
from prefixgrove.worker.isolation import Isolation

log = logging.getLogger(__name__)
DIED_ALONE = "workers died twice running this request alone"  # the error of a second strike
# A group that failed this many deliveries runs request by request, alone: a request that was
# running alone at _STRIKES_TO_FAIL worker deaths is failed instead of killing more workers.
_ALONE_AFTER_FAILURES = 2
_STRIKES_TO_FAIL = 2


class AloneNotes(Protocol):
    """Where a group's request running alone is noted (the job store)."""

    def mark_alone(self, job_id: str, group_id: str, note: AloneNote) -> None: ...

    def ran_alone(self, job_id: str, group_id: str) -> AloneNote | None:
        """The last note, if any."""


class SuspectQueue(Protocol):
    """The group queue, as far as suspects go."""

    @property
    def suspect_waiting(self) -> bool: ...  # the last lease found a suspect waiting

    def take_suspect(self) -> Lease | None: ...

    def abandon(self, lease: Lease) -> None: ...  # taken over again after the lease timeout


@dataclass(frozen=True)
class AloneHistory:
    """What the group's alone note tells a new delivery of it."""

    blamed: int = 0  # failed deliveries that caught a request running alone (not counted as such)
    struck: tuple[int, int] | None = None  # (line index, strikes) of the one the last death caught


@dataclass(eq=False, kw_only=True)
class IsolationPolicy:
    notes: AloneNotes
    suspects: SuspectQueue
    flights: Flights
    running: EngineRequests
    # fail(job_id, error): how a request the policy gives up on is answered
    fail: Callable[[str, RequestError], None]
    isolation: Isolation = field(default_factory=Isolation, init=False)
    suspect: Lease | None = field(default=None, init=False)  # runs with nothing beside it

    @property
    def active(self) -> bool:
        """Requests run apart: the worker takes no new groups meanwhile."""
        return self.isolation.active

    # --- suspects ---------------------------------------------------------------------------
    def suspect_first(self, idle: bool, start: Callable[[Lease], None]) -> bool:
        """Whether a suspect keeps other groups out now: while one runs, and while one waits. A
        waiting one is taken, and started with `start`, once the worker is `idle` (holding
        nothing)."""
        if self.suspect is not None:
            return True
        if not self.suspects.suspect_waiting:
            return False
        if idle:
            self._take_suspect(start)
        return True

    def _take_suspect(self, start: Callable[[Lease], None]) -> None:
        lease = self.suspects.take_suspect()
        if lease is None:
            return
        self.suspect = lease
        try:
            start(lease)
        except BaseException:
            self.suspects.abandon(lease)  # taken over again after the lease timeout
            self.flights.pop(lease)
            self.suspect = None
            raise

    def forget(self, lease: Lease) -> None:
        """The group left the worker (acknowledged, or its lease lost)."""
        if self.suspect is not None and self.suspect.entry_id == lease.entry_id:
            self.suspect = None

    # --- a new delivery ---------------------------------------------------------------------
    def history(self, lease: Lease) -> AloneHistory:
        """A death that caught a request running alone is that request's strike; it does not
        count against the group's max_deliveries (each request has at most two)."""
        if lease.deliveries <= _ALONE_AFTER_FAILURES:
            return AloneHistory()
        last = self.notes.ran_alone(lease.job_id, lease.group_id)
        if last is None:
            return AloneHistory()
        if last.delivery != lease.deliveries - 1:  # that worker ran on, or stopped cleanly
            return AloneHistory(last.blamed)
        return AloneHistory(last.blamed + 1, (last.index, last.strikes + 1))

    def run_group(self, flight: InFlight, history: AloneHistory) -> None:
        """Hands a leased group's requests to the engine: all together, or one at a time once
        the group failed _ALONE_AFTER_FAILURES deliveries."""
        if flight.lease.deliveries > _ALONE_AFTER_FAILURES:
            self._start_alone(flight, history.struck)
            return
        self.running.add(flight, list(flight.requests))

    def _start_alone(self, flight: InFlight, struck: tuple[int, int] | None) -> None:
        """Queues the group's requests to run one at a time with nothing beside them. The one that
        was running alone when the last delivery's worker died (`struck`: its line index and
        strikes now) runs first; at its second strike it is failed."""
        lease = flight.lease
        order = [rid for rid in flight.requests if rid in flight.outstanding]
        culprit = request_id(lease, struck[0]) if struck else None
        if struck is not None and culprit in flight.outstanding:
            order.remove(culprit)
            if struck[1] >= _STRIKES_TO_FAIL:
                self._fail_culprit(culprit, DIED_ALONE)
            else:
                flight.strikes[culprit] = struck[1]
                order.insert(0, culprit)
        log.warning("group %s of job %s failed %d deliveries: running its requests one at a time",
                    lease.group_id, lease.job_id, lease.deliveries - 1)  # fmt: skip
        self.isolation.queue_alone(order)

    # --- a step that raised -----------------------------------------------------------------
    def engine_raised(self, exc: Exception) -> None:
        """Every request the engine held is a suspect: all are aborted and run again apart."""
        running = sorted(self.running.ids)
        log.warning("the engine raised %s: %s, holding %d requests",
                    type(exc).__name__, exc, len(running))  # fmt: skip
        self.running.abort(running)
        culprit = self.isolation.failed(running, exc)
        if culprit is not None:
            log.error("request %s fails alone: failing it", culprit, exc_info=exc)
            message = f"the engine raised {type(exc).__name__}: {exc} (on this request alone)"
            self._fail_culprit(culprit, message)

    def succeeded(self) -> None:
        """The engine answered a request: it is not broken."""
        self.isolation.succeeded()

    def _fail_culprit(self, rid: str, message: str) -> None:
        flight = self.flights.of(rid)
        index, record = flight.requests[rid]
        error = RequestError(index, record.custom_id, "worker_failed", message)
        self.fail(flight.lease.job_id, error)
        flight.outstanding.discard(rid)

    # --- running apart ----------------------------------------------------------------------
    def next_piece(self) -> None:
        """Runs the next suspects with nothing beside them, each group's with its prefix. A
        request about to run alone is noted first, with its strikes, so that the next worker
        knows whom to blame if this one dies (a failed note leaves the piece queued)."""
        self._note_alone()
        by_group: dict[GroupKey, list[str]] = {}
        for rid in self.isolation.next_piece():
            if self.flights.outstanding(rid) is None:
                continue  # cancelled, or taken over by another worker, meanwhile
            by_group.setdefault(group_of(rid), []).append(rid)
        for key, request_ids in by_group.items():
            self.running.add(self.flights[key], request_ids)

    def _note_alone(self) -> None:
        upcoming = self.isolation.pieces[:1]
        if len(upcoming) != 1 or len(upcoming[0]) != 1:
            return  # no piece, or not one request alone
        rid = upcoming[0][0]
        if self.flights.outstanding(rid) is None:
            return
        flight = self.flights.of(rid)
        index = flight.requests[rid][0]
        strikes = flight.strikes.get(rid, 0)
        lease = flight.lease
        note = AloneNote(index, lease.deliveries, strikes, flight.blamed)
        self.notes.mark_alone(lease.job_id, lease.group_id, note)
