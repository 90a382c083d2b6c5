"""A planner started before its Redis says so in one line a try and waits with backoff, then serves
once Redis comes; Redis refusing its password ends the start in one line, exit status 1. Planner
processes and redis-server on loopback."""

from __future__ import annotations

from pathlib import Path

import grpc
from health_checks import serving
from services_testbed import RedisServer, free_port, need_redis, start_planner, wait_until

PASSWORD = "s3cret-of-redis"


def test_a_planner_waits_for_redis_one_line_a_try_then_serves(tmp_path: Path) -> None:
    redis = RedisServer(need_redis(), tmp_path)  # its port is chosen; nothing listens there yet
    port = free_port()
    planner = start_planner(redis.url, port, tmp_path / "planner.log")
    try:
        tries = f"cannot reach Redis at {redis.url}"
        wait_until(lambda: planner.text().count(tries) >= 2, 60, "two tries logged")
        assert "Traceback" not in planner.text()
        assert all(len(row) < 400 for row in planner.text().splitlines() if tries in row)
        redis.start()
        wait_until(lambda: _serving(port), 120, "the planner to serve once Redis is up")
    finally:
        planner.stop()
        redis.kill()


def test_a_planner_whose_redis_refuses_its_password_exits_1_in_one_line(tmp_path: Path) -> None:
    redis = RedisServer(need_redis(), tmp_path, password=PASSWORD)
    redis.start()
    wrong = redis.url.replace(PASSWORD, "not-the-password")
    planner = start_planner(wrong, free_port(), tmp_path / "planner.log")
    try:
        assert planner.wait(120) == 1
        [line] = [row for row in planner.text().splitlines() if "error:" in row]
        assert "refused the planner's credentials" in line and "Traceback" not in planner.text()
        assert "not-the-password" not in planner.text()
    finally:
        planner.stop()
        redis.kill()


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return serving(ch, timeout=5)
