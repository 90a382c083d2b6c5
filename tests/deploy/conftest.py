"""Fixtures of the deployment tests: the real API server (from tests/k8s_fixtures.py), and a real
redis-server + planner for the tests that run the services' own processes."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# NOTE: tests/ is no package (that would shadow the stdlib `operator`), so the shared fixtures
# module and this folder's helpers are put on the path by hand.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deploy_tools import VENV_BIN, Process, kubectl
from k8s_fixtures import KubeApi, free_port, kube_api
from polling import wait_for
from services_testbed import RedisServer, need_redis

__all__ = ["kube_api"]


@pytest.fixture
def namespace(kube_api: KubeApi) -> Iterator[str]:
    """A namespace of its own for the test, deleted (not waited for) after it."""
    name = f"pg-{uuid.uuid4().hex[:8]}"
    kubectl(kube_api, "create", "namespace", name)
    yield name
    kubectl(kube_api, "delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deploy-logs")


@pytest.fixture(scope="session")
def planner_address(logs: Path) -> Iterator[str]:
    """A real redis-server and planner process on free loopback ports."""
    import grpc
    from health_checks import serving

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

    def ready() -> bool:
        planner.check_alive()
        return serving(channel, timeout=1)

    try:
        wait_for("the planner to serve", ready, timeout=90)
        yield address
    finally:
        channel.close()
        planner.stop()
        redis.kill()
