"""Worker autoscaling from the planner's queue depth (groups waiting + leased).

replicas = clamp(ceil(depth / groups_per_worker), min, max); up at once, down only to the highest count
recommended during the last stabilization window, so a short lull never drops workers mid-job.
Each worker pool (a Deployment serving one model) has its own Autoscaler, fed by its model's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kubernetes import client

from prefixgrove_operator.settings import OperatorSettings, WorkerPool

log = logging.getLogger(__name__)


def desired_replicas(depth: int, groups_per_worker: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, math.ceil(max(depth, 0) / groups_per_worker)))


@dataclass
class ScaleDecider:
    """Turns a stream of (time, depth, current replicas) into the replica count to set."""

    groups_per_worker: int
    min_replicas: int
    max_replicas: int
    window_s: float
    _history: deque[tuple[float, int]] = field(default_factory=deque)

    def decide(self, now: float, depth: int, current: int) -> int:
        if not self._history:
            # NOTE: the count already running counts as a recommendation, so a restarted operator
            # waits a full window before scaling down.
            self._history.append((now, current))
        want = desired_replicas(depth, self.groups_per_worker, self.min_replicas, self.max_replicas)
        self._history.append((now, want))
        while self._history and self._history[0][0] < now - self.window_s:
            self._history.popleft()
        if want >= current:
            return want
        return min(current, max(count for _, count in self._history))


class WorkerScaler:
    """Reads and sets the worker Deployment's replicas through its scale subresource."""

    def __init__(self, apps: client.AppsV1Api, name: str, namespace: str) -> None:
        self.apps = apps
        self.name = name
        self.namespace = namespace

    def current(self) -> int:
        scale = self.apps.read_namespaced_deployment_scale(self.name, self.namespace)
        return int(scale.spec.replicas or 0) if scale.spec else 0

    def set(self, replicas: int) -> None:
        self.apps.patch_namespaced_deployment_scale(
            self.name, self.namespace, {"spec": {"replicas": replicas}}
        )


@dataclass
class Autoscaler:
    """Scales one pool's Deployment from its model's queue depth."""

    settings: OperatorSettings
    pool: WorkerPool
    queue_depth: Callable[[], int]
    scaler: WorkerScaler
    clock: Callable[[], float] = time.monotonic
    decider: ScaleDecider = field(init=False)

    def __post_init__(self) -> None:
        p = self.pool
        self.decider = ScaleDecider(
            p.groups_per_worker, p.min_workers, p.max_workers, self.settings.scale_down_window_s
        )

    def step(self) -> tuple[int, int, int]:
        """One round: returns (depth, replicas before, replicas after)."""
        depth = self.queue_depth()
        current = self.scaler.current()
        target = self.decider.decide(self.clock(), depth, current)
        if target != current:
            self.scaler.set(target)
            log.info(
                "scaled %s/%s from %d to %d replicas (queue depth %d)",
                self.scaler.namespace,
                self.scaler.name,
                current,
                target,
                depth,
            )
        return depth, current, target

    async def run(self, stopped: asyncio.Event) -> None:
        """Steps every interval until `stopped` is set; a failed step is logged and retried."""
        while not stopped.is_set():
            try:
                await asyncio.to_thread(self.step)
            except Exception as exc:  # one bad round (planner or API server away) must not end it
                log.warning("autoscaler step failed, retrying next interval: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), timeout=self.settings.autoscale_interval_s)


def pool_autoscalers(
    settings: OperatorSettings,
    queue_depth: Callable[[str], int],
    apps: client.AppsV1Api,
    clock: Callable[[], float] = time.monotonic,
) -> list[Autoscaler]:
    """One Autoscaler for each of settings.pools, fed by queue_depth(the pool's model)."""
    return [
        Autoscaler(
            settings,
            pool,
            queue_depth=functools.partial(queue_depth, pool.model),
            scaler=WorkerScaler(apps, pool.deployment, settings.worker_namespace),
            clock=clock,
        )
        for pool in settings.pools
    ]
