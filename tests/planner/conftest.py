"""The planner tests' client of a planner on loopback, over a redis-server of the test's own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from planner_on_loopback import start
from services_testbed import RedisServer

from prefixgrove.planner.client import PlannerClient


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[PlannerClient]:
    server, port = start(redis_server)
    c = PlannerClient(f"127.0.0.1:{port}")
    yield c
    c.close()
    server.stop(0)
