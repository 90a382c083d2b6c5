"""The health checks and probes the images, the compose file and the chart declare, run for real
against the processes they watch: they pass when the process serves and fail when it does not."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import dockerfile
import pytest
import yaml
from deploy_tools import (
    COMPOSE_FILE,
    REPO,
    VENV_BIN,
    Process,
    container,
    missing,
    template,
)
from k8s_fixtures import free_port
from polling import wait_for

from prefixgrove.worker.metrics import WorkerMetrics


def image_healthcheck(image: str) -> str:
    """The shell command of an image's HEALTHCHECK CMD."""
    commands = dockerfile.parse_file(str(REPO / "docker" / f"{image}.Dockerfile"))
    check = next(c for c in commands if c.cmd == "HEALTHCHECK")
    assert check.value[0] == "CMD"
    return check.value[1]


def compose_healthcheck(service: str) -> list[str]:
    return list(
        yaml.safe_load(COMPOSE_FILE.read_text())["services"][service]["healthcheck"]["test"]
    )


def passes(argv: list[str], env: dict[str, str] | None = None) -> bool:
    path = f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"
    done = subprocess.run(
        argv, env={**os.environ, "PATH": path, **(env or {})}, capture_output=True, timeout=30
    )
    return done.returncode == 0


def exec_form(test: list[str]) -> list[str]:
    """Compose's ["CMD", ...] / ["CMD-SHELL", "..."] as a command line."""
    if test[0] == "CMD-SHELL":
        return ["sh", "-c", test[1]]
    assert test[0] == "CMD"
    return test[1:]


def test_planner_image_healthcheck_follows_the_planners_health(planner_address: str) -> None:
    port = planner_address.rsplit(":", 1)[1]
    command = ["sh", "-c", image_healthcheck("planner")]
    assert passes(command, {"PREFIXGROVE_PORT": port})
    assert not passes(command, {"PREFIXGROVE_PORT": str(free_port())})


def test_compose_planner_healthcheck_follows_the_planners_health(planner_address: str) -> None:
    command = exec_form(compose_healthcheck("planner"))
    assert "127.0.0.1:50051" in command[-1]
    assert passes([*command[:-1], command[-1].replace("127.0.0.1:50051", planner_address)])
    assert not passes([*command[:-1], command[-1].replace("50051", str(free_port()))])


def test_worker_healthchecks_follow_the_metrics_endpoint() -> None:
    port = free_port()
    image = ["sh", "-c", image_healthcheck("worker")]
    compose = exec_form(compose_healthcheck("worker"))
    assert "127.0.0.1:9091" in compose[-1]
    compose = [*compose[:-1], compose[-1].replace("9091", str(port))]
    assert not passes(image, {"PREFIXGROVE_METRICS_PORT": str(port)})
    assert not passes(compose)
    WorkerMetrics().serve(port)  # the endpoint a worker serves, from the worker's own code
    assert passes(image, {"PREFIXGROVE_METRICS_PORT": str(port)})
    assert passes(compose)


@pytest.fixture
def chart_redis(tmp_path: Path) -> Any:
    """redis-server started with the chart's own arguments (AOF on, password from the Secret)."""
    if shutil.which("redis-server") is None:
        missing("no redis-server on PATH; run scripts/ci/install-redis.sh")
    port = free_port()
    statefulset = next(
        o for o in template("--set", f"redis.port={port}") if o["kind"] == "StatefulSet"
    )
    c = container(statefulset, "redis")
    args = [a.replace("$(REDIS_PASSWORD)", "s3cret") for a in c["args"]]
    args[args.index("--dir") + 1] = str(tmp_path)
    server = Process.start(
        "chart-redis", [*c["command"], *args, "--bind", "127.0.0.1"], dict(os.environ), tmp_path
    )
    yield server, c
    server.stop()


def test_chart_redis_probes_authenticate_and_aof_is_written(
    chart_redis: Any, tmp_path: Path
) -> None:
    server, c = chart_redis
    readiness = c["readinessProbe"]["exec"]["command"]
    liveness = c["livenessProbe"]["exec"]["command"]

    def ready() -> bool:
        server.check_alive()
        return passes(readiness, {"REDISCLI_AUTH": "s3cret"})

    wait_for("the chart's Redis readiness probe to pass", ready, timeout=20)
    assert passes(liveness, {"REDISCLI_AUTH": "s3cret"})
    assert not passes(readiness, {"REDISCLI_AUTH": "wrong"})
    assert list(tmp_path.glob("appendonly*")), "no append-only file in the data directory"
