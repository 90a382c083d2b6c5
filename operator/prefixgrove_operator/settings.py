"""The operator's knobs: PREFIXGROVE_<FIELD> environment variables over defaults, read by the loader
the planner and the worker use (prefixgrove.settings.load)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from prefixgrove.settings import SecuritySettings, keeps_empty, load, positive

GROUP = "prefixgrove.io"
VERSION = "v1alpha1"
PLURAL = "batchjobs"

POOL_FORMAT = "DEPLOYMENT=MODEL[:MIN:MAX[:GROUPS_PER_WORKER]]"
_INTEGER = re.compile(r"[+-]?\d+")


@dataclass(frozen=True)
class WorkerPool:
    """One worker Deployment and the model whose queue sets its replicas."""

    deployment: str
    model: str  # "" (the single-deployment settings only): every model's queue counts
    min_workers: int
    max_workers: int
    groups_per_worker: int

    def __post_init__(self) -> None:
        if self.groups_per_worker < 1:
            raise ValueError(f"groups_per_worker must be >= 1, got {self.groups_per_worker}")
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers < 1:
            raise ValueError(
                f"expected 0 <= min_workers <= max_workers and max_workers >= 1, got "
                f"max_workers={self.max_workers}, min_workers={self.min_workers}"
            )

    @classmethod
    def parse(cls, entry: str, defaults: WorkerPool) -> WorkerPool:
        """`DEPLOYMENT=MODEL[:MIN:MAX[:GROUPS_PER_WORKER]]`; the numbers left out come from
        `defaults`. MODEL may hold ':' (llama3:8b); one that ends in ':<integer>' needs all three
        numbers after it, which are always the last three fields."""
        deployment, equals, rest = entry.partition("=")
        deployment, rest = deployment.strip(), rest.strip()
        if not equals or not deployment or not rest or any(c.isspace() for c in deployment):
            raise ValueError(f"worker pool {entry!r} is invalid: expected {POOL_FORMAT}")
        fields = rest.split(":")
        trailing = 0
        while trailing < len(fields) - 1 and _INTEGER.fullmatch(fields[-1 - trailing].strip()):
            trailing += 1
        if trailing == 1:
            raise ValueError(
                f"worker pool {entry!r} is invalid: expected {POOL_FORMAT} (MIN and MAX go "
                "together; a MODEL ending in ':<integer>' needs MIN:MAX:GROUPS_PER_WORKER after it)"
            )
        numbers = [int(f) for f in fields[len(fields) - min(trailing, 3) :]]
        model = ":".join(fields[: len(fields) - len(numbers)]).strip()
        if not model:
            raise ValueError(f"worker pool {entry!r} is invalid: expected {POOL_FORMAT}")
        given = [defaults.min_workers, defaults.max_workers, defaults.groups_per_worker]
        given[: len(numbers)] = numbers
        lo, hi, per_worker = given
        try:
            return cls(deployment, model, lo, hi, per_worker)
        except ValueError as exc:
            raise ValueError(f"worker pool {entry!r} is invalid: {exc}") from None


def parse_worker_pools(value: str, defaults: WorkerPool) -> tuple[WorkerPool, ...]:
    """Comma-separated pools; a Deployment or a model named twice is refused."""
    pools = tuple(WorkerPool.parse(e.strip(), defaults) for e in value.split(",") if e.strip())
    for attribute in ("deployment", "model"):
        names = [getattr(p, attribute) for p in pools]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(
                f"worker_pools={value!r} is invalid: {attribute} {twice[0]!r} is in two pools"
            )
    return pools


@dataclass(frozen=True)
class OperatorSettings:
    planner_address: str = "127.0.0.1:50051"  # planner gRPC target, host:port
    planner_token: str = ""  # bearer token the planner asks for; empty when it runs without one
    # PEM files for TLS to the planner (a CA turns TLS on; a client pair adds mutual TLS)
    planner_tls_ca: str = ""
    planner_tls_client_cert: str = ""
    planner_tls_client_key: str = ""
    rpc_timeout_s: float = 10.0
    status_interval_s: float = 5.0  # between status refreshes of a running BatchJob
    retry_delay_s: float = 5.0  # before retrying a handler whose planner call failed
    # a BatchJob Queued this long (no worker has leased a group of it) gets the Unserved condition
    # and a Warning Event
    unserved_warning_s: float = 60.0
    # ... and this long is cancelled and Failed, unless its spec.queueTimeoutSeconds says otherwise
    queue_timeout_s: float = 1800.0
    # how long a deleted BatchJob waits for its planner job to be cancelled before it is let go
    cancel_timeout_s: float = 600.0
    # root of the volume that BatchJob input/output paths are confined to, as the planner sees it
    shared_volume_root: str = "/data"
    # the worker Deployment the autoscaler drives; an empty name turns autoscaling off
    worker_deployment: str = keeps_empty("prefixgrove-worker")
    worker_namespace: str = "default"
    worker_model: str = ""  # only this model's queue counts for the workers; empty: every model
    groups_per_worker: int = 4
    min_workers: int = 0
    max_workers: int = 8
    # one Deployment per model, DEPLOYMENT=MODEL[:MIN:MAX[:GROUPS_PER_WORKER]] comma-separated (the
    # numbers left out: min_workers, max_workers, groups_per_worker); set, it replaces
    # worker_deployment and worker_model
    worker_pools: str = ""
    autoscale_interval_s: float = 10.0
    scale_down_window_s: float = 300.0  # scale down once lower counts were asked for this long

    def __post_init__(self) -> None:
        if not self.planner_address or ":" not in self.planner_address:
            raise ValueError(f"planner_address must be host:port, got {self.planner_address!r}")
        if bool(self.planner_tls_client_cert) != bool(self.planner_tls_client_key):
            raise ValueError(
                "planner_tls_client_cert and planner_tls_client_key must be given together"
            )
        _ = self.pools  # raises for bad bounds or a bad worker_pools entry
        positive(self, "rpc_timeout_s", "status_interval_s", "retry_delay_s",
                 "autoscale_interval_s", "cancel_timeout_s", "unserved_warning_s",
             "queue_timeout_s")  # fmt: skip
        if self.scale_down_window_s < 0:
            raise ValueError(f"scale_down_window_s must be >= 0, got {self.scale_down_window_s}")
        if not self.shared_volume_root.startswith("/"):
            raise ValueError(
                f"shared_volume_root must be an absolute path, got {self.shared_volume_root!r}"
            )

    @property
    def pools(self) -> tuple[WorkerPool, ...]:
        """The Deployments the autoscaler drives: worker_pools, else worker_deployment (counting
        worker_model's queue), else none."""
        single = WorkerPool(
            self.worker_deployment, self.worker_model, self.min_workers, self.max_workers,
            self.groups_per_worker,
        )  # fmt: skip
        if self.worker_pools.strip():
            return parse_worker_pools(self.worker_pools, single)
        return (single,) if self.worker_deployment else ()

    @property
    def autoscaling(self) -> bool:
        return bool(self.pools)

    @property
    def planner_security(self) -> SecuritySettings:
        """How the planner client authenticates: empty settings mean none."""
        return SecuritySettings(
            auth_token=self.planner_token or None,
            tls_ca=self.planner_tls_ca or None,
            tls_client_cert=self.planner_tls_client_cert or None,
            tls_client_key=self.planner_tls_client_key or None,
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorSettings:
        """PREFIXGROVE_<FIELD> (upper case) for every field; unset ones keep their defaults."""
        return load(cls, env=environ)
