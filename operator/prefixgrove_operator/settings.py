"""The operator's knobs, read from PREFIXGROVE_* environment variables here and nowhere else."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

ENV_PREFIX = "PREFIXGROVE_"

GROUP = "prefixgrove.io"
VERSION = "v1alpha1"
PLURAL = "batchjobs"


@dataclass(frozen=True)
class OperatorSettings:
    # planner gRPC target, host:port
    planner_address: str = "127.0.0.1:50051"
    # bearer token the planner asks for; empty when it runs without one
    planner_token: str = ""
    # PEM files for TLS to the planner (a CA turns TLS on; a client pair adds mutual TLS)
    planner_tls_ca: str = ""
    planner_tls_client_cert: str = ""
    planner_tls_client_key: str = ""
    rpc_timeout_s: float = 10.0
    # seconds between status refreshes of a running BatchJob
    status_interval_s: float = 5.0
    # delay before retrying a handler whose planner call failed
    retry_delay_s: float = 5.0
    # how long a deleted BatchJob waits for its planner job to be cancelled before it is let go
    cancel_timeout_s: float = 600.0
    # root of the volume that BatchJob input/output paths are confined to, as the planner sees it
    shared_volume_root: str = "/data"
    # the worker Deployment the autoscaler drives; an empty name turns autoscaling off
    worker_deployment: str = "prefixgrove-worker"
    worker_namespace: str = "default"
    # only this model's queue counts for the workers; empty counts every model
    worker_model: str = ""
    groups_per_worker: int = 4
    min_workers: int = 0
    max_workers: int = 8
    autoscale_interval_s: float = 10.0
    # scale-down waits until lower replica counts were recommended for this long
    scale_down_window_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.planner_address or ":" not in self.planner_address:
            raise ValueError(f"planner_address must be host:port, got {self.planner_address!r}")
        if bool(self.planner_tls_client_cert) != bool(self.planner_tls_client_key):
            raise ValueError(
                "planner_tls_client_cert and planner_tls_client_key must be given together"
            )
        if self.groups_per_worker < 1:
            raise ValueError(f"groups_per_worker must be >= 1, got {self.groups_per_worker}")
        if self.min_workers < 0:
            raise ValueError(f"min_workers must be >= 0, got {self.min_workers}")
        if self.max_workers < max(self.min_workers, 1):
            raise ValueError(
                f"max_workers must be >= max(min_workers, 1), got max_workers={self.max_workers}, "
                f"min_workers={self.min_workers}"
            )
        for name in (
            "rpc_timeout_s",
            "status_interval_s",
            "retry_delay_s",
            "autoscale_interval_s",
            "cancel_timeout_s",
        ):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.scale_down_window_s < 0:
            raise ValueError(f"scale_down_window_s must be >= 0, got {self.scale_down_window_s}")
        if not self.shared_volume_root.startswith("/"):
            raise ValueError(
                f"shared_volume_root must be an absolute path, got {self.shared_volume_root!r}"
            )

    @property
    def autoscaling(self) -> bool:
        return bool(self.worker_deployment)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorSettings:
        """Reads PREFIXGROVE_<FIELD> (upper case) for every field; unset ones keep their defaults."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for field in fields(cls):
            raw = env.get(ENV_PREFIX + field.name.upper())
            if raw is None:
                continue
            kind = type(getattr(cls, field.name))
            try:
                values[field.name] = kind(raw)
            except ValueError:
                raise ValueError(
                    f"{ENV_PREFIX}{field.name.upper()}={raw!r} is not a valid {kind.__name__}"
                ) from None
        return cls(**values)  # type: ignore[arg-type]
