"""The system the campaign attacks: one redis-server with AOF, planner replicas on fixed ports and
faulty workers (tests/worker/faulty_worker.py) as real processes. Every process can be killed with
SIGKILL and started again in its place; a worker that dies by itself (on a poison request) is
started again by `supervise`, which the campaign calls in its loop. Besides kills: clients of their
own (fault_client.py) that stall streams or die mid-upload, and a Redis whose maxmemory is lowered
until it refuses writes for a while; `supervise` ends both when their time is up."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import redis
from fault_job import POISON_TOKEN
from services_testbed import (
    MAX_MODEL_LEN,
    MODEL,
    Process,
    RedisServer,
    free_port,
    service_env,
    start_planner,
    wait_for_port,
)

from prefixgrove.planner.client import PlannerClient, PlannerUnavailable

FAULTY_WORKER = str(Path(__file__).resolve().parents[1] / "worker" / "faulty_worker.py")
FAULT_CLIENT = str(Path(__file__).with_name("fault_client.py"))
LEASE_TIMEOUT_S = "3"
# how long a planner's stream may wait on its client before the planner ends it: short, so the
# stalled streams are ended while the job runs
STREAM_TIMEOUT_S = "15"
RESTART_AFTER_DEATH_S = 0.5  # a process that died by itself, as a supervisor would
CALL_TIMEOUT_S = 10.0
T = TypeVar("T")


@dataclass
class Slot:
    """One planner replica or worker: the process now in it, and when a stopped one comes back."""

    name: str
    port: int = 0  # a planner's gRPC port, kept across restarts; 0 for a worker
    proc: Process | None = None
    back_at: float | None = None  # monotonic time to start it again; None: not waiting


@dataclass
class FaultStack:
    dir: Path
    redis: RedisServer
    planners: list[Slot] = field(default_factory=list)
    workers: list[Slot] = field(default_factory=list)
    worker_flags: tuple[str, ...] = ()  # more `serve worker` flags, for every worker
    # processes that died by themselves: for workers, the poison requests' doing
    self_deaths: dict[str, int] = field(default_factory=lambda: {"worker": 0, "planner": 0})
    clients: list[tuple[Process, float]] = field(default_factory=list)  # (client, killed at)
    redis_full_until: float | None = None  # monotonic time to give Redis its memory back

    @classmethod
    def start(
        cls, workdir: Path, planners: int, workers: int, worker_flags: tuple[str, ...] = ()
    ) -> FaultStack:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/ci/install-redis.sh)")
        redis = RedisServer(binary, workdir, aof=True)
        redis.start()
        stack = cls(workdir, redis, worker_flags=worker_flags)
        stack.planners = [Slot(f"planner{i}", free_port()) for i in range(planners)]
        stack.workers = [Slot(f"w{i}") for i in range(workers)]
        for slot in stack.planners:
            stack._start_planner(slot)
        for slot in stack.workers:
            stack._start_worker(slot)
        for slot in stack.planners:
            assert slot.proc is not None
            wait_for_port(slot.port, slot.proc, timeout=120)
        return stack

    def _start_planner(self, slot: Slot) -> None:
        timeouts = ("--upload-idle-timeout-s", STREAM_TIMEOUT_S,
                    "--stream-stall-timeout-s", STREAM_TIMEOUT_S)  # fmt: skip
        slot.proc = start_planner(self.redis.url, slot.port, self.dir / f"{slot.name}.log",
                                  *timeouts)  # fmt: skip
        slot.back_at = None

    def _start_worker(self, slot: Slot) -> None:
        args = ["--redis-url", self.redis.url, "--model", MODEL, "--device", "cpu",
                "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                "--consumer", slot.name, "--lease-timeout-s", LEASE_TIMEOUT_S,
                "--max-groups-in-flight", "2", "--cancel-poll-s", "0.5",
                "--poison-token", str(POISON_TOKEN), "--fault", "die",
                *self.worker_flags]  # fmt: skip
        log = self.dir / f"{slot.name}.log"
        slot.proc = Process(args, log, service_env(), program=(FAULTY_WORKER,))
        slot.back_at = None

    # --- faults -----------------------------------------------------------------------------
    def kill_worker(self, index: int, down_s: float) -> None:
        self._kill(self.workers[index], down_s)

    def kill_planner(self, index: int, down_s: float) -> None:
        self._kill(self.planners[index], down_s)

    def _kill(self, slot: Slot, down_s: float) -> None:
        assert slot.proc is not None
        slot.proc.stop()  # SIGKILL and reap
        slot.back_at = time.monotonic() + down_s

    def kill_redis(self, down_s: float) -> None:
        """SIGKILL, then the same port and directory: the append-only file brings it all back."""
        self.redis.kill()
        time.sleep(down_s)
        self.redis.start()

    def start_client(self, name: str, *args: str, lasts_s: float = float("inf")) -> Process:
        """A fault_client.py process (its mode and arguments), killed after `lasts_s`."""
        client = Process(list(args), self.dir / f"{name}.log", service_env(),
                         program=(FAULT_CLIENT,))  # fmt: skip
        self.clients.append((client, time.monotonic() + lasts_s))
        return client

    def fill_redis(self, full_s: float) -> None:
        """Lowers Redis's maxmemory below what it holds (noeviction: every write that takes
        memory is refused) for `full_s`; `supervise` gives it back. A Redis restarted meanwhile
        starts with its memory back."""
        self._config_set("maxmemory-policy", "noeviction")
        self._config_set("maxmemory", 1)
        self.redis_full_until = time.monotonic() + full_s

    def _config_set(self, name: str, value: str | int) -> None:
        """CONFIG SET, waiting for a Redis just started again to load its AOF."""
        deadline = time.monotonic() + 30
        while True:
            try:
                self.redis.client().config_set(name, value)
                return
            except redis.ConnectionError:  # BusyLoadingError among them
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def supervise(self) -> None:
        """Starts again what is due: killed processes after their time down, and at once (after
        a short pause) workers that died by themselves; kills clients whose time is up and gives
        Redis its memory back when due."""
        for kind, slots, start in (("worker", self.workers, self._start_worker),
                                   ("planner", self.planners, self._start_planner)):  # fmt: skip
            for slot in slots:
                self._restart_if_due(kind, slot, start)
        now = time.monotonic()
        for client, until in [c for c in self.clients if c[1] <= now]:
            client.stop()
            self.clients.remove((client, until))
        if self.redis_full_until is not None and now >= self.redis_full_until:
            self._config_set("maxmemory", 0)
            self.redis_full_until = None

    def _restart_if_due(self, kind: str, slot: Slot, start: Callable[[Slot], None]) -> None:
        now = time.monotonic()
        assert slot.proc is not None
        if slot.back_at is None and slot.proc.proc.poll() is not None:
            self.self_deaths[kind] += 1
            slot.back_at = now + RESTART_AFTER_DEATH_S
        if slot.back_at is not None and now >= slot.back_at:
            start(slot)

    # --- talking to it ----------------------------------------------------------------------
    def up_planners(self) -> list[Slot]:
        return [s for s in self.planners if s.back_at is None]

    def call(
        self, what: str, fn: Callable[[PlannerClient], T], timeout_s: float | None = CALL_TIMEOUT_S
    ) -> T:
        """fn(client) through the first planner replica that answers; PlannerUnavailable when
        none does (all down, or Redis down behind them)."""
        last: PlannerUnavailable | None = None
        for slot in self.up_planners():
            client = PlannerClient(f"127.0.0.1:{slot.port}", timeout_s=timeout_s)
            try:
                return fn(client)
            except PlannerUnavailable as exc:
                last = exc
            finally:
                client.close()
        raise last or PlannerUnavailable(grpc.StatusCode.UNAVAILABLE, f"{what}: no planner is up")

    def stop(self) -> None:
        for client, _ in self.clients:
            client.stop()
        for slot in [*self.planners, *self.workers]:
            if slot.proc is not None:
                slot.proc.stop()
        self.redis.kill()
