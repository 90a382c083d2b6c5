"""Fixtures of the deployment tests: the real API server (from tests/k8s_fixtures.py), and a real
redis-server + planner for the tests that run the services' own processes."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# NOTE: tests/ is no package (that would shadow the stdlib `operator`), so the shared fixtures
# module and this folder's helpers are put on the path by hand.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deploy_tools import VENV_BIN, Process
from k8s_fixtures import free_port, kube_api
from polling import wait_for
from services_testbed import RedisServer, need_redis

__all__ = ["kube_api"]


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deploy-logs")


@pytest.fixture(scope="session")
def planner_address(logs: Path) -> Iterator[str]:
    """A real redis-server and planner process on free loopback ports."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    planner_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGROVE_")}
    redis = RedisServer(need_redis(), logs)
    redis.start()
    planner = Process.start(
        "planner",
        [str(VENV_BIN / "prefixgrove"), "serve", "planner", "--host", "127.0.0.1",
         "--port", str(planner_port), "--redis-url", redis.url],
        env,
        logs,
    )  # fmt: skip
    address = f"127.0.0.1:{planner_port}"
    channel = grpc.insecure_channel(address)

    def serving() -> bool:
        planner.check_alive()
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    try:
        wait_for("the planner to serve", serving, timeout=90)
        yield address
    finally:
        channel.close()
        planner.stop()
        redis.kill()
