"""Fixtures of the operator tests; they live in operator_testbed.py and k8s_fixtures.py."""

import sys
from pathlib import Path

# NOTE: tests/ is no package (that would shadow the standard library's `operator` here), so the
# shared fixtures module is put on the path by hand.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k8s_fixtures import kube_api
from operator_testbed import (
    batchjobs,
    cpu_worker,
    crd,
    logs_dir,
    operator,
    operator_env,
    planner,
    planner_address,
    redis_url,
    volume,
    worker_deployment,
)

__all__ = [
    "batchjobs",
    "cpu_worker",
    "crd",
    "kube_api",
    "logs_dir",
    "operator",
    "operator_env",
    "planner",
    "planner_address",
    "redis_url",
    "volume",
    "worker_deployment",
]
