"""The isolation policy on its own: which requests run together or alone, whom a death or a raise is
blamed on, and when a suspect group is taken, against in-memory stand-ins for the job store's alone
notes, the group queue and the engine (test_faults.py runs the same rules in real workers)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from prefixgrove.grouping import PrefixGroup
from prefixgrove.jobs.redis_store.alone_note import AloneNote
from prefixgrove.jobs.redis_store.queue import Lease
from prefixgrove.jobs.redis_store.schema import RequestRecord
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.worker.engine_requests import EngineRequests
from prefixgrove.worker.flights import Flights, InFlight, request_id
from prefixgrove.worker.isolation_policy import DIED_ALONE, AloneHistory, IsolationPolicy

JOB = "job_1"
PREFIX_LEN = 8


class Notes:
    """The job store's alone notes, in a dict."""

    def __init__(self) -> None:
        self.notes: dict[tuple[str, str], AloneNote] = {}

    def mark_alone(self, job_id: str, group_id: str, note: AloneNote) -> None:
        self.notes[(job_id, group_id)] = note

    def ran_alone(self, job_id: str, group_id: str) -> AloneNote | None:
        return self.notes.get((job_id, group_id))


class Suspects:
    """The group queue's suspects: those in `waiting` are taken in order."""

    def __init__(self) -> None:
        self.waiting: list[Lease] = []
        self.abandoned: list[Lease] = []

    @property
    def suspect_waiting(self) -> bool:
        return bool(self.waiting)

    def take_suspect(self) -> Lease | None:
        return self.waiting.pop(0) if self.waiting else None

    def abandon(self, lease: Lease) -> None:
        self.abandoned.append(lease)


class Engine:
    """Records what it is handed: one entry per call, (prefix shared, request ids)."""

    def __init__(self) -> None:
        self.added: list[tuple[int, list[str]]] = []
        self.aborted: list[str] = []

    def add_group(self, group_id: str, group: PrefixGroup, requests: Sequence[Any]) -> None:
        self.added.append((group.prefix_len, [rid for rid, _, _ in requests]))

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: Any) -> None:
        self.added.append((0, [request_id]))

    def abort(self, request_ids: Sequence[str]) -> None:
        self.aborted += request_ids

    def ran(self) -> list[list[str]]:
        return [ids for _, ids in self.added]


@dataclass
class Rig:
    notes: Notes = field(default_factory=Notes)
    suspects: Suspects = field(default_factory=Suspects)
    engine: Engine = field(default_factory=Engine)
    flights: Flights = field(default_factory=Flights)
    failed: list[RequestError] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.running = EngineRequests(self.engine)  # type: ignore[arg-type]
        self.policy = IsolationPolicy(notes=self.notes, suspects=self.suspects,
                                      flights=self.flights, running=self.running,
                                      fail=lambda job_id, error: self.failed.append(error))  # fmt: skip

    def hold(self, group: str = "g", deliveries: int = 1, n: int = 4, blamed: int = 0) -> InFlight:
        """A flight of `n` requests (line indices 0..n-1) sharing a prefix, held by the worker."""
        lease = Lease(f"{deliveries}-0", JOB, group, deliveries)
        flight = InFlight(lease, {}, prefix_len=PREFIX_LEN, blamed=blamed)
        for index in range(n):
            tokens = np.arange(PREFIX_LEN + 2, dtype=np.int32) + index
            record = RequestRecord(f"r{index}", "completions", {"max_tokens": 3}, tokens)
            flight.requests[request_id(lease, index)] = (index, record)
        flight.outstanding = set(flight.requests)
        self.flights.add(flight)
        return flight

    def start(self, flight: InFlight) -> None:
        """Hands a newly leased group over, as the worker does."""
        self.policy.run_group(flight, self.policy.history(flight.lease))

    def answer(self, rid: str) -> None:
        """The engine finished the request and the worker collected it."""
        self.running.answered(rid)
        self.policy.succeeded()
        self.flights.of(rid).outstanding.discard(rid)


def ids(flight: InFlight, *indices: int) -> list[str]:
    return [request_id(flight.lease, i) for i in indices]


def test_a_group_delivered_at_most_twice_runs_all_of_its_requests_together() -> None:
    rig = Rig()
    flight = rig.hold(deliveries=2)
    rig.start(flight)
    assert rig.engine.added == [(PREFIX_LEN, ids(flight, 0, 1, 2, 3))]
    assert not rig.policy.active


def test_a_group_that_failed_two_deliveries_runs_request_by_request_each_noted_first() -> None:
    rig = Rig()
    flight = rig.hold(deliveries=3)
    rig.start(flight)
    assert rig.engine.added == [] and rig.policy.active
    for index, rid in enumerate(ids(flight, 0, 1, 2, 3)):
        rig.policy.next_piece()
        assert rig.engine.added[-1] == (PREFIX_LEN, [rid])  # alone, with its group's prefix
        assert rig.notes.ran_alone(JOB, "g") == AloneNote(index, 3)
        rig.answer(rid)
    rig.policy.next_piece()
    assert not rig.policy.active


def test_the_first_two_deliveries_read_no_note() -> None:
    rig = Rig()
    rig.notes.mark_alone(JOB, "g", AloneNote(2, delivery=1))
    assert rig.policy.history(Lease("2-0", JOB, "g", 2)) == AloneHistory()


def test_a_death_while_a_request_ran_alone_is_its_strike_not_the_groups_failure() -> None:
    rig = Rig()
    rig.notes.mark_alone(JOB, "g", AloneNote(2, delivery=3, strikes=0, blamed=0))
    assert rig.policy.history(Lease("4-0", JOB, "g", 4)) == AloneHistory(blamed=1, struck=(2, 1))


def test_a_note_of_an_earlier_delivery_keeps_its_blame_and_strikes_nobody() -> None:
    rig = Rig()
    rig.notes.mark_alone(JOB, "g", AloneNote(2, delivery=3, strikes=1, blamed=1))
    assert rig.policy.history(Lease("5-0", JOB, "g", 5)) == AloneHistory(blamed=1)


def test_a_request_struck_once_runs_first_and_its_note_carries_the_strike() -> None:
    rig = Rig()
    flight = rig.hold(deliveries=4, blamed=1)
    rig.policy.run_group(flight, AloneHistory(blamed=1, struck=(2, 1)))
    rig.policy.next_piece()
    assert rig.engine.ran() == [ids(flight, 2)]
    assert rig.notes.ran_alone(JOB, "g") == AloneNote(2, 4, strikes=1, blamed=1)
    assert not rig.failed


def test_a_request_struck_twice_is_failed_and_the_rest_run_alone() -> None:
    rig = Rig()
    flight = rig.hold(deliveries=5, blamed=2)
    rig.policy.run_group(flight, AloneHistory(blamed=2, struck=(1, 2)))
    assert [(e.index, e.code, e.message) for e in rig.failed] == [(1, "worker_failed", DIED_ALONE)]
    assert ids(flight, 1)[0] not in flight.outstanding
    for rid in ids(flight, 0, 2, 3):
        rig.policy.next_piece()
        rig.answer(rid)
    assert rig.engine.ran() == [ids(flight, 0), ids(flight, 2), ids(flight, 3)]


def test_when_the_engine_raises_all_it_held_is_aborted_and_run_again_in_halves() -> None:
    rig = Rig()
    a, b = rig.hold("a", n=3), rig.hold("b", n=1)
    rig.start(a)
    rig.start(b)
    rig.policy.engine_raised(RuntimeError("boom"))
    held = sorted(ids(a, 0, 1, 2) + ids(b, 0))
    assert sorted(rig.engine.aborted) == held and not rig.running
    assert rig.policy.active and not rig.failed
    rig.policy.next_piece()
    assert rig.engine.ran()[-1] == ids(a, 0, 1)
    for rid in ids(a, 0, 1):
        rig.answer(rid)
    rig.policy.next_piece()  # a half of two groups: each runs with its own prefix
    assert rig.engine.added[-2:] == [(PREFIX_LEN, ids(a, 2)), (PREFIX_LEN, ids(b, 0))]


def test_a_request_the_engine_raises_on_alone_is_failed_with_the_engines_error() -> None:
    rig = Rig()
    flight = rig.hold(n=2)
    rig.start(flight)
    rig.policy.engine_raised(RuntimeError("boom"))
    rig.policy.next_piece()
    assert rig.engine.ran()[-1] == ids(flight, 0)
    rig.policy.engine_raised(RuntimeError("boom"))
    message = "the engine raised RuntimeError: boom (on this request alone)"
    assert [(e.index, e.code, e.message) for e in rig.failed] == [(0, "worker_failed", message)]
    assert flight.outstanding == set(ids(flight, 1))
    rig.policy.next_piece()
    assert rig.engine.ran()[-1] == ids(flight, 1)


def test_requests_gone_meanwhile_are_neither_run_nor_noted() -> None:
    rig = Rig()
    flight = rig.hold(deliveries=3, n=2)
    rig.start(flight)
    flight.outstanding.discard(ids(flight, 0)[0])  # its job cancelled, say
    rig.policy.next_piece()
    assert rig.engine.added == [] and rig.notes.ran_alone(JOB, "g") is None
    rig.policy.next_piece()
    assert rig.engine.ran() == [ids(flight, 1)]
    assert rig.notes.ran_alone(JOB, "g") == AloneNote(1, 3)


def test_a_waiting_suspect_keeps_other_groups_out_and_is_taken_once_the_worker_is_idle() -> None:
    rig = Rig()
    suspect = Lease("2-0", JOB, "s", 2)
    rig.suspects.waiting.append(suspect)
    started: list[Lease] = []
    assert rig.policy.suspect_first(idle=False, start=started.append)
    assert started == [] and rig.policy.suspect is None
    assert rig.policy.suspect_first(idle=True, start=started.append)
    assert started == [suspect]
    # while it runs nothing joins it, and no other suspect is taken
    rig.suspects.waiting.append(Lease("3-0", JOB, "t", 2))
    assert rig.policy.suspect_first(idle=True, start=started.append)
    assert started == [suspect]
    rig.policy.forget(Lease("1-0", JOB, "other"))
    assert rig.policy.suspect == suspect
    rig.policy.forget(suspect)
    assert rig.policy.suspect is None


def test_no_suspect_waiting_leaves_leasing_alone() -> None:
    rig = Rig()
    started: list[Lease] = []
    assert not rig.policy.suspect_first(idle=True, start=started.append)
    assert started == []


class StartFailed(Exception):
    pass


def test_a_suspect_that_fails_to_start_is_abandoned_and_forgotten() -> None:
    rig = Rig()
    suspect = Lease("2-0", JOB, "g", 2)
    rig.suspects.waiting.append(suspect)

    def start(lease: Lease) -> None:
        rig.hold("g", deliveries=2)
        raise StartFailed

    with pytest.raises(StartFailed):
        rig.policy.suspect_first(idle=True, start=start)
    assert rig.suspects.abandoned == [suspect]
    assert len(rig.flights) == 0 and rig.policy.suspect is None
