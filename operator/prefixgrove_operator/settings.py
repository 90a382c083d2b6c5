"""The operator's knobs: PREFIXGROVE_<FIELD> environment variables over defaults, read by the loader
the planner and the worker use (prefixgrove.settings.load)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prefixgrove.settings import SecuritySettings, keeps_empty, load, positive

GROUP = "prefixgrove.io"
VERSION = "v1alpha1"
PLURAL = "batchjobs"


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
    autoscale_interval_s: float = 10.0
    scale_down_window_s: float = 300.0  # scale down once lower counts were asked for this long

    def __post_init__(self) -> None:
        if not self.planner_address or ":" not in self.planner_address:
            raise ValueError(f"planner_address must be host:port, got {self.planner_address!r}")
        if bool(self.planner_tls_client_cert) != bool(self.planner_tls_client_key):
            raise ValueError(
                "planner_tls_client_cert and planner_tls_client_key must be given together"
            )
        if self.groups_per_worker < 1:
            raise ValueError(f"groups_per_worker must be >= 1, got {self.groups_per_worker}")
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers < 1:
            raise ValueError(
                f"expected 0 <= min_workers <= max_workers and max_workers >= 1, got "
                f"max_workers={self.max_workers}, min_workers={self.min_workers}"
            )
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
    def autoscaling(self) -> bool:
        return bool(self.worker_deployment)

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
