"""A planner served over gRPC on loopback for the service tests, with the calls they make of it."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from services_testbed import MODEL, RedisServer, batch_line

from prefixgrove.planner.client import PlannerError
from prefixgrove.planner.server import PlannerServer, build_server
from prefixgrove.settings import IngestSettings, PlannerSettings, SecuritySettings


def start(
    redis: RedisServer, security: SecuritySettings | None = None
) -> tuple[PlannerServer, int]:
    planner = PlannerSettings(redis_url=redis.url, host="127.0.0.1", port=0, model=MODEL)
    server = build_server(
        planner, IngestSettings(max_model_len=512), security or SecuritySettings()
    )
    return server, server.port


def lines(n: int, prefix: str = "Shared instructions for every request. " * 4) -> list[bytes]:
    return [
        batch_line(f"r{i}", {"prompt": f"{prefix}item {i}", "max_tokens": 2}).encode()
        for i in range(n)
    ]


def rejection(call) -> PlannerError:  # type: ignore[no-untyped-def]
    with pytest.raises(PlannerError) as info:
        call()
    return info.value


def code_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    return rejection(call).code


def batch_file(path: Path, content: list[bytes]) -> Path:
    """`content`'s lines written to `path`, one a line."""
    path.write_bytes(b"\n".join(content) + b"\n")
    return path
