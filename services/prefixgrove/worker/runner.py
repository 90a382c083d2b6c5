"""The worker loop: lease whole groups, run many at once in one engine, write results as requests
finish, acknowledge a group once all of its results are written. When the engine raises, the
requests it held are run apart until the one that raises is alone (isolation.py); the other groups
stay here and finish.

A group taken over after a failed delivery (a suspect: its worker died, of it or of a neighbour)
runs with nothing beside it: the worker stops leasing, finishes what it holds, takes the suspect and
leases nothing else until it is done. A death then counts against the suspect alone, so a group
that shared a worker with a poison group spends one delivery on it, not all of them. A suspect
that failed two deliveries runs request by request, each alone; a request that was the one running
alone at two deaths is failed (one death may be a kill from outside, which a delivery cannot tell
from a crash). A request run apart keeps its group's prefix (a group of one), so its output is the
same bytes as in its group.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from prefixgrove.engine_settings import EngineSettings
from prefixgrove.grouping import PrefixGroup
from prefixgrove.jobs.output_lines import success_line
from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.queue import GroupQueue, Lease
from prefixgrove.jobs.redis_store.schema import RequestRecord, ResultRecord
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.jobs.request_errors import RequestError, engine_error
from prefixgrove.jobs.sampling_fields import sampling_kwargs
from prefixgrove.settings import WorkerSettings
from prefixgrove.worker.isolation import Isolation
from prefixgrove.worker.lease_budget import Capacity, Held, LeaseBudget
from prefixgrove.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)
DIED_ALONE = "workers died twice running this request alone"  # the error of a second strike
# A group that failed this many deliveries runs request by request, alone: a request that was
# running alone at _STRIKES_TO_FAIL worker deaths is failed instead of killing more workers.
_ALONE_AFTER_FAILURES = 2
_STRIKES_TO_FAIL = 2


@dataclass
class _InFlight:
    lease: Lease
    requests: dict[str, tuple[int, RequestRecord]]  # engine request id -> (line index, record)
    outstanding: set[str] = field(default_factory=set)
    prefix_len: int = 0  # tokens its requests share (their KV is held once)
    # request id -> deaths it was running alone at (kept while it runs alone again)
    strikes: dict[str, int] = field(default_factory=dict)
    blamed: int = 0  # failed deliveries that caught one of its requests running alone
    # request id -> the most KV tokens it holds beyond the shared prefix
    kv_tokens: dict[str, int] = field(default_factory=dict)
    leased_at: float = 0.0  # time.monotonic() at the lease

    def held(self) -> tuple[int, int]:
        """(sequences, KV tokens) of what is still to answer."""
        if not self.outstanding:
            return 0, 0
        tokens = self.prefix_len + sum(self.kv_tokens[r] for r in self.outstanding)
        return sum(_samples(self.requests[r][1]) for r in self.outstanding), tokens


@dataclass(frozen=True)
class _AloneHistory:
    """What the group's alone note tells a new delivery of it."""

    blamed: int = 0  # failed deliveries that caught a request running alone (not counted as such)
    struck: tuple[int, int] | None = None  # (line index, strikes) of the one the last death caught


@dataclass
class _Pending:
    job_id: str
    index: int
    result: ResultRecord
    completion_tokens: int


class Worker:
    def __init__(self, settings: WorkerSettings, engine: Any) -> None:
        self.settings = settings
        self.consumer = settings.consumer or f"{socket.gethostname()}-{os.getpid()}"
        self._give_up = threading.Event()  # set: Redis is not waited for any more (stopping)
        self.store = JobStore(connect(settings.redis_url, give_up=self._give_up))
        self.queue = GroupQueue(
            self.store.r, settings.served_name, self.consumer, settings.lease_timeout_s
        )
        self.engine = engine
        self.budget = LeaseBudget(
            _capacity(self.engine), settings.lease_ahead, settings.max_groups_in_flight
        )
        self.metrics = WorkerMetrics(model=settings.served_name)
        self._inflight: dict[tuple[str, str], _InFlight] = {}
        self._running: set[str] = set()  # request ids the engine holds now
        self._isolation = Isolation()
        self._suspect: Lease | None = None  # runs with nothing beside it
        self._pending: list[_Pending] = []
        self._last_cancel_poll = 0.0
        self._tokens_window = (time.monotonic(), 0)
        self._reused_seen = 0
        self._prefill_seen = 0

    # --- the loop ---------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Works until `stop` is set, then finishes what it holds (or gives it back after the
        drain timeout) and returns; with Redis unreachable it returns within stop_timeout_s."""
        finished = threading.Event()
        watcher = threading.Thread(
            target=self._watch_stop, args=(stop, finished), name="stop-watch", daemon=True
        )
        watcher.start()
        self._retry(lambda: self.store.ensure_queue(self.settings.served_name))
        keepalive_stop = threading.Event()
        self.queue.start_keepalive(self.settings.keepalive_s, keepalive_stop)
        log.info("worker %s serving %s", self.consumer, self.settings.served_name)
        drain_deadline: float | None = None
        failed = True  # until the loop ends by itself: groups given back count as failed on
        try:
            while not self._give_up.is_set():
                if stop.is_set() and drain_deadline is None:
                    drain_deadline = time.monotonic() + self.settings.drain_timeout_s
                    log.info("stopping: finishing %d groups in flight", len(self._inflight))
                if drain_deadline is not None and (
                    not self._inflight or time.monotonic() > drain_deadline
                ):
                    break
                taking = drain_deadline is None
                self._retry(lambda taking=taking: self._iteration(taking))
            failed = False
        finally:
            keepalive_stop.set()
            self._retry(lambda: self._release_all(failed))
            finished.set()
            watcher.join(timeout=2.0)  # NOTE: a thread still running at exit can abort the process

    def _watch_stop(self, stop: threading.Event, finished: threading.Event) -> None:
        """Once stopping, a Redis that stays unreachable for half of stop_timeout_s is given up
        on: every command then fails at once instead of retrying for a minute, so the worker
        gives back what it can and exits within the timeout."""
        while not stop.wait(0.25):
            if finished.is_set():
                return
        probe = connect(self.settings.redis_url, retries=0, socket_timeout=1.0)
        down_since: float | None = None
        with probe:
            while not finished.wait(0.25):
                try:
                    probe.ping()
                    down_since = None
                except redis.RedisError:
                    down_since = down_since or time.monotonic()
                    if time.monotonic() - down_since >= self.settings.stop_timeout_s / 2:
                        log.warning("stopping with redis unreachable: giving up on it")
                        self._give_up.set()
                        return

    def _iteration(self, taking: bool) -> None:
        clock = time.perf_counter()
        idle = not (self._inflight or self._pending)  # a lease now may wait for work to come
        self._drop_lost()
        self._poll_cancel()
        if taking and not self._isolation.active:
            self._lease_more()
        if self._isolation.active and not self._running and not self._pending:
            self._next_piece()
        clock = self._account("idle" if idle else "lease", clock)
        if self.engine.has_unfinished_requests():
            self._step()
        self._engine_gauges()
        clock = self._account("step", clock)
        self._flush()
        self._account("write", clock)

    def _account(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.metrics.loop_seconds[phase].inc(now - since)
        return now

    def _retry(self, fn: Any) -> None:
        try:
            fn()
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
            log.warning("redis unavailable (%s); retrying", exc)
            self._give_up.wait(1.0)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.store.ensure_queue(self.settings.served_name)  # Redis came back without its data

    # --- leasing ----------------------------------------------------------------------------
    def _lease_more(self) -> None:
        """Leases groups until the engine's batch and KV cache (and a little ahead) are spoken
        for, or the queue has no more: the first groups teach the budget their size. No group
        beside a suspect: while one waits, the worker finishes what it holds, then takes it."""
        if self._suspect is not None:
            return
        if self.queue.suspect_waiting:
            if not self._inflight and not self._pending:
                self._take_suspect()
            return
        block_ms = 0 if self.engine.has_unfinished_requests() or self._pending else 500
        while True:
            held = self._held()
            self.metrics.requests_held.set(held.requests)
            ask = self.budget.groups_to_ask(held)
            if ask <= 0:
                return
            leases = self.queue.take(ask, block_ms, suspects=False)
            for i, lease in enumerate(leases):
                try:
                    self._start(lease)
                except BaseException:
                    # Stop keeping it and those not started alive: after the lease timeout a
                    # worker takes them over.
                    for left in leases[i:]:
                        self.queue.abandon(left)
                    raise
            if len(leases) < ask:
                return  # nothing more queued now
            block_ms = 0

    def _take_suspect(self) -> None:
        lease = self.queue.take_suspect()
        if lease is None:
            return
        self._suspect = lease
        try:
            self._start(lease)
        except BaseException:
            self.queue.abandon(lease)  # taken over again after the lease timeout
            self._inflight.pop((lease.job_id, lease.group_id), None)
            self._suspect = None
            raise

    def _start(self, lease: Lease) -> None:
        leased_at = time.monotonic()
        job_id, group_id = lease.job_id, lease.group_id
        if lease.deliveries > 1:
            self.metrics.groups_taken_over.inc()
        else:
            self.metrics.queue_wait.observe(_queue_wait(lease.entry_id))
        self.store.mark_leased(job_id, group_id)  # before the state check: see schema.CANCEL
        state = self.store.job_state(job_id)
        loaded = None
        if state is not None and state.runnable and not self.store.is_group_done(job_id, group_id):
            loaded = self.store.load_group(job_id, group_id)
        if loaded is None:
            self._finish(lease)
            return
        group, records = loaded
        history = self._alone_history(lease)
        flight, accepted = self._admit(
            lease, group.indices, records, lease.deliveries - history.blamed
        )
        flight.blamed, flight.leased_at = history.blamed, leased_at
        flight.prefix_len = _shared_prefix(group.prefix_len, accepted)
        max_len = self.engine.config.model.max_model_len
        flight.kv_tokens = {
            rid: _own_kv_tokens(record, flight.prefix_len, max_len)
            for rid, (_, record) in flight.requests.items()
        }
        self.budget.observe(*flight.held())
        self._inflight[(job_id, group_id)] = flight
        self.metrics.groups_leased.set(len(self._inflight))
        if lease.deliveries > _ALONE_AFTER_FAILURES:
            self._start_alone(flight, history.struck)
            return
        self._add(flight, list(flight.requests))

    def _alone_history(self, lease: Lease) -> _AloneHistory:
        """A death that caught a request running alone is that request's strike; it does not
        count against the group's max_deliveries (each request has at most two)."""
        if lease.deliveries <= _ALONE_AFTER_FAILURES:
            return _AloneHistory()
        last = self.store.ran_alone(lease.job_id, lease.group_id)
        if last is None:
            return _AloneHistory()
        index, delivery, strikes, blamed = last
        if delivery != lease.deliveries - 1:  # that worker ran on, or stopped cleanly
            return _AloneHistory(blamed)
        return _AloneHistory(blamed + 1, (index, strikes + 1))

    def _add(self, flight: _InFlight, request_ids: list[str]) -> None:
        """Hands these requests of the group to the engine, with the group's prefix when it has
        one: the same arithmetic whether they run beside all of their group or alone."""
        self._running.update(request_ids)
        requests = []
        for rid in request_ids:
            record = flight.requests[rid][1]
            requests.append((rid, record.prompt_token_ids, _params(record)))
        if flight.prefix_len:
            shared = PrefixGroup(flight.prefix_len, tuple(range(len(requests))))
            group_id = f"{flight.lease.job_id}/{flight.lease.group_id}"
            self.engine.add_group(group_id, shared, requests)
            return
        for request in requests:
            self.engine.add_request(*request)

    def _held(self) -> Held:
        sequences = tokens = 0
        for flight in self._inflight.values():
            n, t = flight.held()
            sequences += n
            tokens += t
        return Held(len(self._inflight), sequences, tokens)

    def _admit(
        self, lease: Lease, indices: list[int], records: list[RequestRecord], failures: int
    ) -> tuple[_InFlight, list[RequestRecord]]:
        """The group's requests still to run, and every request of it the engine accepts (answered
        ones too: the group the local run forms). Those the engine refuses fail here, and all of
        them once `failures` (deliveries less those blamed on a request alone) passes
        max_deliveries."""
        answered = self.store.read_answered(lease.job_id, indices)
        flight, accepted = _InFlight(lease, {}), []
        for index, record in zip(indices, records, strict=True):
            if index in answered:
                accepted += [record] if self._accepts(record) else []
                continue
            error = self._check(index, record, failures)
            if error is not None:
                self._fail(lease.job_id, error)
                continue
            flight.requests[f"{lease.job_id}/{lease.group_id}/{index}"] = (index, record)
            accepted.append(record)
        flight.outstanding = set(flight.requests)
        return flight, accepted

    def _accepts(self, record: RequestRecord) -> bool:
        try:
            self.engine.validate(record.prompt_token_ids, _params(record))
        except ValueError:
            return False
        return True

    def _start_alone(self, flight: _InFlight, struck: tuple[int, int] | None) -> None:
        """Queues the group's requests to run one at a time with nothing beside them. The one that
        was running alone when the last delivery's worker died (`struck`: its line index and
        strikes now) runs first; at its second strike it is failed."""
        lease = flight.lease
        order = [rid for rid in flight.requests if rid in flight.outstanding]
        culprit = f"{lease.job_id}/{lease.group_id}/{struck[0]}" if struck else None
        if struck is not None and culprit in flight.outstanding:
            order.remove(culprit)
            if struck[1] >= _STRIKES_TO_FAIL:
                self._fail_culprit(culprit, DIED_ALONE)
            else:
                flight.strikes[culprit] = struck[1]
                order.insert(0, culprit)
        log.warning("group %s of job %s failed %d deliveries: running its requests one at a time",
                    lease.group_id, lease.job_id, lease.deliveries - 1)  # fmt: skip
        self._isolation.queue_alone(order)

    def _check(self, index: int, record: RequestRecord, failures: int) -> RequestError | None:
        if failures > self.settings.max_deliveries:
            return RequestError(index, record.custom_id, "worker_failed",
                                f"the request's group stopped {failures - 1} workers "
                                f"(max_deliveries={self.settings.max_deliveries})")  # fmt: skip
        try:
            self.engine.validate(record.prompt_token_ids, _params(record))
        except ValueError as exc:
            return engine_error(index, record.custom_id, exc)
        return None

    # --- isolating a request the engine raises on -------------------------------------------
    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._engine_raised(exc)
            return
        self._collect(outputs)

    def _engine_raised(self, exc: Exception) -> None:
        running = sorted(self._running)
        log.warning("the engine raised %s: %s, holding %d requests",
                    type(exc).__name__, exc, len(running))  # fmt: skip
        self.engine.abort(running)
        self._running.clear()
        culprit = self._isolation.failed(running, exc)
        if culprit is not None:
            log.error("request %s fails alone: failing it", culprit, exc_info=exc)
            message = f"the engine raised {type(exc).__name__}: {exc} (on this request alone)"
            self._fail_culprit(culprit, message)

    def _fail_culprit(self, request_id: str, message: str) -> None:
        job_id, group_id, _ = request_id.split("/")
        flight = self._inflight[(job_id, group_id)]
        index, record = flight.requests[request_id]
        self._fail(job_id, RequestError(index, record.custom_id, "worker_failed", message))
        flight.outstanding.discard(request_id)

    def _next_piece(self) -> None:
        """Runs the next suspects with nothing beside them, each group's with its prefix. A
        request about to run alone is noted first, with its strikes, so that the next worker
        knows whom to blame if this one dies (a failed note leaves the piece queued)."""
        upcoming = self._isolation.pieces[:1]
        if len(upcoming) == 1 and len(upcoming[0]) == 1 and self._outstanding(upcoming[0][0]):
            request_id = upcoming[0][0]
            job_id, group_id, index = request_id.split("/")
            flight = self._inflight[(job_id, group_id)]
            strikes = flight.strikes.get(request_id, 0)
            delivery = flight.lease.deliveries
            self.store.mark_alone(job_id, group_id, int(index), delivery, strikes, flight.blamed)
        by_group: dict[tuple[str, str], list[str]] = {}
        for request_id in self._isolation.next_piece():
            if self._outstanding(request_id) is None:
                continue  # cancelled, or taken over by another worker, meanwhile
            job_id, group_id, _ = request_id.split("/")
            by_group.setdefault((job_id, group_id), []).append(request_id)
        for key, request_ids in by_group.items():
            self._add(self._inflight[key], request_ids)

    def _outstanding(self, request_id: str) -> tuple[int, RequestRecord] | None:
        """(line index, record) of a request this worker still has to answer."""
        job_id, group_id, _ = request_id.split("/")
        flight = self._inflight.get((job_id, group_id))
        if flight is None or request_id not in flight.outstanding:
            return None
        return flight.requests[request_id]

    # --- results ----------------------------------------------------------------------------
    def _fail(self, job_id: str, error: RequestError) -> None:
        self._pending.append(_Pending(job_id, error.index, ResultRecord(True, error.to_line()), 0))
        self.metrics.requests_failed.inc()

    def _collect(self, outputs: list[Any]) -> None:
        tokenizer = self.engine.tokenizer
        for out in outputs:
            self._running.discard(out.request_id)
            found = self._outstanding(out.request_id)
            if found is None:
                continue  # aborted (cancelled, or taken over by another worker)
            self._isolation.succeeded()
            job_id, group_id, _ = out.request_id.split("/")
            flight = self._inflight[(job_id, group_id)]
            index, record = found
            line = success_line(index, record.custom_id, record.endpoint, record.params,
                                self.settings.served_name, out, tokenizer,
                                requested_model=record.model)  # fmt: skip
            tokens = sum(len(c.token_ids) for c in out.outputs)
            self._pending.append(_Pending(job_id, index, ResultRecord(False, line), tokens))
            flight.outstanding.discard(out.request_id)
            self.metrics.requests_done.inc()
            self.metrics.output_tokens.inc(tokens)
            self._count_tokens(tokens)

    def _engine_gauges(self) -> None:
        """The engine's prompt tokens (computed, reused) since the last call, and what it holds."""
        engine, metrics = self.engine, self.metrics
        reused, prefill = engine.metrics.prefix_tokens_reused, engine.metrics.prefill_tokens
        metrics.prefix_tokens_reused.inc(max(reused - self._reused_seen, 0))
        metrics.prompt_tokens.inc(max(prefill - self._prefill_seen, 0))
        self._reused_seen, self._prefill_seen = reused, prefill
        metrics.kv_cache_usage.set(engine.kv_cache_usage())
        metrics.requests_running.set(engine.num_running_requests())
        metrics.requests_waiting.set(engine.num_waiting_requests())

    def _flush(self) -> None:
        by_job: dict[str, list[tuple[int, ResultRecord, int]]] = {}
        for p in self._pending:
            by_job.setdefault(p.job_id, []).append((p.index, p.result, p.completion_tokens))
        for job_id, results in by_job.items():
            self.store.write_results(job_id, results)
        self._pending.clear()  # only once every write went through: a failed write is retried
        for flight in [f for f in self._inflight.values() if not f.outstanding]:
            self._finish(flight.lease)

    def _finish(self, lease: Lease) -> None:
        self.store.finish_group(lease.job_id, lease.group_id)
        self.queue.ack(lease)
        self._forget_suspect(lease)
        flight = self._inflight.pop((lease.job_id, lease.group_id), None)
        if flight is not None:
            self.metrics.groups_done.inc()
            self.metrics.group_run.observe(time.monotonic() - flight.leased_at)
        self.metrics.groups_leased.set(len(self._inflight))

    # --- cancel, takeover, shutdown ---------------------------------------------------------
    def _poll_cancel(self) -> None:
        now = time.monotonic()
        if now - self._last_cancel_poll < self.settings.cancel_poll_s:
            return
        self._last_cancel_poll = now
        for job_id in {job for job, _ in self._inflight}:
            state = self.store.job_state(job_id)
            if state is None or not state.runnable:
                flights = [f for (job, _), f in self._inflight.items() if job == job_id]
                log.info("job %s is %s: dropping %d groups", job_id, state, len(flights))
                for flight in flights:
                    self._abort(flight)
                self._flush()

    def _drop_lost(self) -> None:
        for lease in self.queue.lost():
            flight = self._inflight.pop((lease.job_id, lease.group_id), None)
            if flight is not None:
                log.warning("lost the lease on group %s of job %s", lease.group_id, lease.job_id)
                self._abort(flight)
            self._forget_suspect(lease)

    def _forget_suspect(self, lease: Lease) -> None:
        if self._suspect is not None and self._suspect.entry_id == lease.entry_id:
            self._suspect = None

    def _abort(self, flight: _InFlight) -> None:
        self.engine.abort(list(flight.outstanding))
        self._running.difference_update(flight.outstanding)
        flight.outstanding.clear()

    def _release_all(self, failed: bool) -> None:
        """Writes the results it holds and gives its groups back, counted as a failed delivery
        when the worker stops on an error. Once Redis is given up on, what is left is taken over
        by another worker after the lease timeout (counted too)."""
        try:
            self._flush()
            for flight in list(self._inflight.values()):
                self._abort(flight)
                self.queue.release(flight.lease, failed)
                self._inflight.pop((flight.lease.job_id, flight.lease.group_id), None)
                log.info("gave back group %s of job %s", flight.lease.group_id, flight.lease.job_id)
        except redis.RedisError as exc:
            if not self._give_up.is_set():
                raise
            log.warning("redis unreachable (%s): %d groups and %d results left behind; the groups "
                        "are taken over after the lease timeout", exc, len(self._inflight),
                        len(self._pending))  # fmt: skip

    def _count_tokens(self, tokens: int) -> None:
        start, count = self._tokens_window
        count += tokens
        elapsed = time.monotonic() - start
        if elapsed >= 5.0:
            self.metrics.tokens_per_second.set(count / elapsed)
            start, count = time.monotonic(), 0
        self._tokens_window = (start, count)


def _queue_wait(entry_id: str) -> float:
    """Seconds since the group's stream entry was added: its id starts with Redis's clock in
    milliseconds at the XADD (0 where this host's clock is behind Redis's)."""
    queued_ms = int(entry_id.split("-", 1)[0])
    return max(time.time() - queued_ms / 1000, 0.0)


def _shared_prefix(prefix_len: int, accepted: list[RequestRecord]) -> int:
    """The prefix the engine shares among all of the group's accepted requests, as the local run
    groups them (none for a group left with one; each request keeps a token of its own; one asking
    for prompt logprobs runs outside the group), so that any part of the group run later, even a
    single request, shares the same prefix."""
    if len(accepted) < 2:
        return 0
    shared = [r for r in accepted if r.params.get("prompt_logprobs") is None]
    own_token_after = [len(r.prompt_token_ids) - 1 for r in shared]
    return max(0, min(prefix_len, *own_token_after)) if own_token_after else 0


def _samples(record: RequestRecord) -> int:
    return int(record.params.get("n") or 1)


def _own_kv_tokens(record: RequestRecord, prefix_len: int, max_model_len: int) -> int:
    """The most KV a request holds beyond its group's shared prefix: its own prompt tokens and
    the tokens it may generate, for each of its samples."""
    prompt = len(record.prompt_token_ids)
    limit = max(max_model_len - prompt, 0)
    new = min(record.params.get("max_tokens") or limit, limit)
    return (prompt - prefix_len + new) * _samples(record)


def _capacity(engine: Any) -> Capacity:
    config = engine.config
    return Capacity(
        requests=config.scheduler.max_num_seqs,
        kv_tokens=engine.blocks.num_usable * config.cache.block_size,
    )


def _params(record: RequestRecord) -> Any:
    from prefixgrove.engine import SamplingParams

    return SamplingParams(**sampling_kwargs(record.params))


def make_engine(model: str, settings: EngineSettings) -> Any:
    """The engine a worker runs `model` on: built from the same settings, through the same
    resolution of defaults, as `LLM(...)` and `prefixgrove run`."""
    from prefixgrove.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig.from_settings(model, settings))
