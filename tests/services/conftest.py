"""Fixtures of the services tests; the helpers behind them are in services_testbed.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from services_testbed import RedisServer, need_redis


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(need_redis(), tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def aof_redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(need_redis(), tmp_path, aof=True)
    server.start()
    yield server
    server.kill()
