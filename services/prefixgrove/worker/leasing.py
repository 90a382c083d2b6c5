"""Groups in and out of a worker: leased as long as its engine has room for them (lease_budget.py),
loaded with the requests they still have to answer (those the engine refuses fail at once), and
acknowledged once all of their results are written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from prefixgrove.jobs.redis_store.queue import GroupQueue, Lease
from prefixgrove.jobs.redis_store.schema import GroupRecord, RequestRecord
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.jobs.request_errors import RequestError, engine_error
from prefixgrove.settings import WorkerSettings
from prefixgrove.worker.engine_protocol import Engine
from prefixgrove.worker.engine_requests import sampling_params, token_ids
from prefixgrove.worker.flights import Flights, InFlight, own_kv_tokens, request_id, shared_prefix
from prefixgrove.worker.isolation_policy import IsolationPolicy
from prefixgrove.worker.lease_budget import LeaseBudget
from prefixgrove.worker.metrics import WorkerMetrics
from prefixgrove.worker.results import Results

_WAIT_FOR_WORK_MS = 500  # how long a lease waits for a group while the engine has nothing to do


@dataclass
class Leasing:
    settings: WorkerSettings
    store: JobStore
    queue: GroupQueue
    engine: Engine
    budget: LeaseBudget
    metrics: WorkerMetrics
    flights: Flights
    results: Results
    isolation: IsolationPolicy

    def lease_more(self) -> None:
        """Leases groups until the engine's batch and KV cache (and a little ahead) are spoken
        for, or the queue has no more: the first groups teach the budget their size. No group
        beside a suspect: while one waits, the worker finishes what it holds, then takes it."""
        idle = not self.flights and not self.results.pending
        if self.isolation.suspect_first(idle, self.start):
            return
        busy = self.engine.has_unfinished_requests() or self.results.pending
        block_ms = 0 if busy else _WAIT_FOR_WORK_MS
        while True:
            held = self.flights.held()
            self.metrics.requests_held.set(held.requests)
            ask = self.budget.groups_to_ask(held)
            if ask <= 0:
                return
            sent = self.queue.sent
            leases = self.queue.take(ask, block_ms, suspects=False)
            self.metrics.groups_sent.inc(self.queue.sent - sent)
            self._start_all(leases)
            if len(leases) < ask:
                return  # nothing more queued now
            block_ms = 0

    def _start_all(self, leases: list[Lease]) -> None:
        for i, lease in enumerate(leases):
            try:
                self.start(lease)
            except redis.OutOfMemoryError:
                for left in leases[i + 1 :]:  # given back as they came: no fault of theirs
                    self.queue.release(left, failed=False)
                raise
            except BaseException:
                # Stop keeping it and those not started alive: after the lease timeout a
                # worker takes them over.
                for left in leases[i:]:
                    self.queue.abandon(left)
                raise

    def start(self, lease: Lease) -> None:
        """Loads a leased group and hands its requests to the engine (as the isolation policy
        says); a group with nothing left to run is acknowledged at once. A group Redis has no
        memory to note as leased is given back as it came (no delivery counted)."""
        leased_at = time.monotonic()
        try:
            loaded = self._load(lease)
            if loaded is None:
                self.finish(lease)
                return
        except redis.OutOfMemoryError:
            self.queue.release(lease, failed=False)
            raise
        group, records = loaded
        history = self.isolation.history(lease)
        flight, accepted = self._admit(
            lease, group.indices, records, lease.deliveries - history.blamed
        )
        flight.blamed, flight.leased_at = history.blamed, leased_at
        flight.prefix_len = shared_prefix(group.prefix_len, accepted)
        max_len = self.engine.config.model.max_model_len
        flight.kv_tokens = {
            rid: own_kv_tokens(record, flight.prefix_len, max_len)
            for rid, (_, record) in flight.requests.items()
        }
        self.budget.observe(*flight.held())
        self.flights.add(flight)
        self.metrics.groups_leased.set(len(self.flights))
        self.isolation.run_group(flight, history)

    def _load(self, lease: Lease) -> tuple[GroupRecord, list[RequestRecord]] | None:
        """The group and its request records; None when its job stopped or the group is done."""
        job_id, group_id = lease.job_id, lease.group_id
        if lease.deliveries > 1:
            self.metrics.groups_taken_over.inc()
        else:
            self.metrics.queue_wait.observe(_queue_wait(lease.entry_id))
        self.store.mark_leased(job_id, group_id)  # before the state check: see schema.CANCEL
        state = self.store.job_state(job_id)
        if state is not None and state.runnable and not self.store.is_group_done(job_id, group_id):
            return self.store.load_group(job_id, group_id)
        return None

    def _admit(
        self, lease: Lease, indices: list[int], records: list[RequestRecord], failures: int
    ) -> tuple[InFlight, list[RequestRecord]]:
        """The group's requests still to run, and every request of it the engine accepts (answered
        ones too: the group the local run forms). Those the engine refuses fail here, and all of
        them once `failures` (deliveries less those blamed on a request alone) passes
        max_deliveries."""
        answered = self.store.read_answered(lease.job_id, indices)
        flight, accepted = InFlight(lease, {}), []
        for index, record in zip(indices, records, strict=True):
            if index in answered:
                accepted += [record] if self._accepts(record) else []
                continue
            error = self._check(index, record, failures)
            if error is not None:
                self.results.fail(lease.job_id, error)
                continue
            flight.requests[request_id(lease, index)] = (index, record)
            accepted.append(record)
        flight.outstanding = set(flight.requests)
        return flight, accepted

    def _accepts(self, record: RequestRecord) -> bool:
        try:
            self.engine.validate(token_ids(record), sampling_params(record))
        except ValueError:
            return False
        return True

    def _check(self, index: int, record: RequestRecord, failures: int) -> RequestError | None:
        max_deliveries = self.settings.max_deliveries
        if failures > max_deliveries:
            return RequestError(index, record.custom_id, "worker_failed",
                                f"the request's group stopped {failures - 1} workers "
                                f"(max_deliveries={max_deliveries})")  # fmt: skip
        try:
            self.engine.validate(token_ids(record), sampling_params(record))
        except ValueError as exc:
            return engine_error(index, record.custom_id, exc)
        return None

    def finish(self, lease: Lease) -> None:
        """Acknowledges a group: its results are written, or it had nothing to run."""
        self.store.finish_group(lease.job_id, lease.group_id)
        self.queue.ack(lease)
        self.isolation.forget(lease)
        flight = self.flights.pop(lease)
        if flight is not None:
            self.metrics.groups_done.inc()
            self.metrics.group_run.observe(time.monotonic() - flight.leased_at)
        self.metrics.groups_leased.set(len(self.flights))

    def finish_answered(self) -> None:
        """Acknowledges every group with nothing left to answer (call once its results are
        written)."""
        for flight in [f for f in self.flights if not f.outstanding]:
            self.finish(flight.lease)


def _queue_wait(entry_id: str) -> float:
    """Seconds since the group's stream entry was added: its id starts with Redis's clock in
    milliseconds at the XADD (0 where this host's clock is behind Redis's)."""
    queued_ms = int(entry_id.split("-", 1)[0])
    return max(time.time() - queued_ms / 1000, 0.0)
