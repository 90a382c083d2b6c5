"""The worker loop: lease whole groups, run many at once in one engine, write results as requests
finish, acknowledge a group once all of its results are written. Its parts, one file each:
leasing.py takes groups in and acknowledges them, flights.py keeps what each group has still to
answer, engine_requests.py what the engine holds, results.py writes the answers,
isolation_policy.py decides what runs alone when the engine raises or workers die, stopping.py
drains and gives back on the way out.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import redis

from prefixgrove.affinity_settings import AffinitySettings
from prefixgrove.engine_settings import EngineSettings
from prefixgrove.jobs.prompt_parts import PartsEngine
from prefixgrove.jobs.redis_store.affinity import PrefixAffinity
from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.queue import GroupQueue
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.settings import WorkerSettings
from prefixgrove.worker.engine_protocol import Engine
from prefixgrove.worker.engine_requests import EngineRequests
from prefixgrove.worker.flights import Flights
from prefixgrove.worker.isolation_policy import DIED_ALONE, IsolationPolicy
from prefixgrove.worker.lease_budget import Capacity, LeaseBudget
from prefixgrove.worker.leasing import Leasing
from prefixgrove.worker.metrics import WorkerMetrics
from prefixgrove.worker.redis_full import RedisFull, has_room
from prefixgrove.worker.results import Results
from prefixgrove.worker.stopping import Drain, give_back, watch_redis

__all__ = ["DIED_ALONE", "Worker", "make_engine"]
log = logging.getLogger(__name__)


class Worker:
    def __init__(
        self, settings: WorkerSettings, engine: Engine, affinity: AffinitySettings | None = None
    ) -> None:
        """`affinity`: prefix-affine leasing (default: on, AffinitySettings' defaults)."""
        self.settings = settings
        self.consumer = settings.consumer or f"{socket.gethostname()}-{os.getpid()}"
        self._give_up = threading.Event()  # set: Redis is not waited for any more (stopping)
        self.store = JobStore(connect(settings.redis_url, give_up=self._give_up))
        self.queue = GroupQueue(self.store.r, settings.served_name, self.consumer,
                                settings.lease_timeout_s, self._affinity(affinity))  # fmt: skip
        self._engine = engine
        self.budget = LeaseBudget(
            _capacity(self._engine), settings.lease_ahead, settings.max_groups_in_flight
        )
        self.metrics = WorkerMetrics(model=settings.served_name)
        self.redis_full = RedisFull(self.metrics, self._give_up.wait)
        self.flights = Flights()
        self.running = EngineRequests(engine)
        self.results = Results(self.store, self.metrics, settings.served_name, engine.tokenizer)
        self.isolation = IsolationPolicy(
            notes=self.store,
            suspects=self.queue,
            flights=self.flights,
            running=self.running,
            fail=self.results.fail,
        )
        self.leasing = Leasing(
            settings=settings,
            store=self.store,
            queue=self.queue,
            engine=engine,
            budget=self.budget,
            metrics=self.metrics,
            flights=self.flights,
            results=self.results,
            isolation=self.isolation,
        )
        self._last_cancel_poll = 0.0

    def _affinity(self, settings: AffinitySettings | None) -> PrefixAffinity | None:
        settings = settings or AffinitySettings()
        if not settings.prefix_affinity:
            return None
        lease_timeout_s = self.settings.lease_timeout_s
        return PrefixAffinity(self.store.r, self.settings.served_name, self.consumer,
                              ttl_s=lease_timeout_s, wait_s=settings.wait_s(lease_timeout_s),
                              max_prefixes=settings.affinity_prefixes,
                              backlog=settings.affinity_backlog)  # fmt: skip

    @property
    def engine(self) -> Engine:
        """NOTE: fixed at construction (its parts hold it too): wrap an engine before handing it
        over, never swap it afterwards."""
        return self._engine

    # --- the loop ---------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Works until `stop` is set, then finishes what it holds (or gives it back after the
        drain timeout) and returns; with Redis unreachable it returns within stop_timeout_s."""
        finished = threading.Event()
        watcher = threading.Thread(target=watch_redis, name="stop-watch", daemon=True,
                                   args=(stop, finished, self.settings, self._give_up))  # fmt: skip
        watcher.start()
        self._retry(lambda: self.store.ensure_queue(self.settings.served_name))
        keepalive_stop = threading.Event()
        self.queue.start_keepalive(self.settings.keepalive_s, keepalive_stop)
        log.info("worker %s serving %s", self.consumer, self.settings.served_name)
        drain = Drain(stop, self.settings.drain_timeout_s)
        failed = True  # until the loop ends by itself: groups given back count as failed on
        try:
            while not self._give_up.is_set() and not drain.over(len(self.flights)):
                self._retry(partial(self._iteration, drain.taking))
            failed = False
        finally:
            keepalive_stop.set()
            self._retry(lambda: self._release_all(failed))
            finished.set()
            watcher.join(timeout=2.0)  # NOTE: a thread still running at exit can abort the process

    def _iteration(self, taking: bool) -> None:
        clock = time.perf_counter()
        idle = not (self.flights or self.results.pending)  # a lease now may wait for work to come
        self._drop_lost()
        self._poll_cancel()
        if taking and not self.isolation.active and not self.redis_full.full:
            self.leasing.lease_more()
        if self.isolation.active and not self.running and not self.results.pending:
            self.isolation.next_piece()
        clock = self._account("idle" if idle else "lease", clock)
        if self._engine.has_unfinished_requests():
            self._step()
        self.metrics.observe_engine(self._engine)
        clock = self._account("step", clock)
        self._flush()
        self._account("write", clock)

    def _account(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.metrics.loop_seconds[phase].inc(now - since)
        return now

    def _retry(self, fn: Callable[[], None]) -> None:
        try:
            fn()
            self.redis_full.went_through(lambda: has_room(self.store.r))
        except redis.OutOfMemoryError as exc:
            self.redis_full.refused(exc, self._holding())
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
            log.warning("redis unavailable (%s); retrying", exc)
            self._give_up.wait(1.0)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # Redis came back without its data
            self._retry(lambda: self.store.ensure_queue(self.settings.served_name))

    def _holding(self) -> str:
        results, groups = len(self.results.pending), len(self.flights)
        return f"{results} results not yet written, {groups} group(s) leased"

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            self.isolation.engine_raised(exc)
            return
        for out in outputs:
            self.running.answered(out.request_id)
            if self.flights.outstanding(out.request_id) is None:
                continue  # aborted (cancelled, or taken over by another worker)
            self.isolation.succeeded()
            self.results.answer(self.flights.of(out.request_id), out)

    def _flush(self) -> None:
        self.results.write()
        self.leasing.finish_answered()

    # --- cancel, takeover, shutdown ---------------------------------------------------------
    def _poll_cancel(self) -> None:
        now = time.monotonic()
        if now - self._last_cancel_poll < self.settings.cancel_poll_s:
            return
        self._last_cancel_poll = now
        for job_id in {flight.lease.job_id for flight in self.flights}:
            state = self.store.job_state(job_id)
            if state is None or not state.runnable:
                flights = [f for f in self.flights if f.lease.job_id == job_id]
                log.info("job %s is %s: dropping %d groups", job_id, state, len(flights))
                for flight in flights:
                    self.running.drop(flight)
                self._flush()

    def _drop_lost(self) -> None:
        for lease in self.queue.lost():
            flight = self.flights.pop(lease)
            if flight is not None:
                log.warning("lost the lease on group %s of job %s", lease.group_id, lease.job_id)
                self.running.drop(flight)
            self.isolation.forget(lease)

    def _release_all(self, failed: bool) -> None:
        """Writes the results it holds and gives its groups back, counted as a failed delivery
        when the worker stops on an error. Once Redis is given up on, what is left is taken over
        by another worker after the lease timeout (counted too)."""
        try:
            self._flush()
        except redis.OutOfMemoryError as exc:
            log.warning("redis is out of memory (%s): %d results not written; their groups are "
                        "given back and run again", exc, len(self.results.pending))  # fmt: skip
        try:
            give_back(self.flights, self.running, self.queue, failed)
            if self.queue.affinity is not None:
                self.queue.affinity.withdraw()
        except redis.RedisError as exc:
            if not self._give_up.is_set():
                raise
            log.warning("redis unreachable (%s): %d groups and %d results left behind; the groups "
                        "are taken over after the lease timeout", exc, len(self.flights),
                        len(self.results.pending))  # fmt: skip


def _capacity(engine: Any) -> Capacity:
    config = engine.config
    return Capacity(
        requests=config.scheduler.max_num_seqs,
        kv_tokens=engine.blocks.num_usable * config.cache.block_size,
    )


def make_engine(model: str, settings: EngineSettings) -> Any:
    """The engine a worker runs `model` on: built from the same settings, through the same
    resolution of defaults, as `LLM(...)` and `prefixgrove run`, except one: unset, a worker's
    engine spans every GPU its pod was given (one worker, the capacity of all of them)."""
    from prefixgrove.engine import EngineConfig, LLMEngine

    if settings.tensor_parallel_size is None:
        settings = settings.replace(tensor_parallel_size=visible_gpus(settings.device))
    # a completions line of several prompts runs each as a request of its own
    return PartsEngine(LLMEngine(EngineConfig.from_settings(model, settings)))


def visible_gpus(device: str) -> int:
    """The GPUs this process may use from `device` on (1 on the CPU)."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return 1
    first = int(device.split(":")[1]) if ":" in device else 0
    return max(1, torch.cuda.device_count() - first)
