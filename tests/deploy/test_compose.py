"""docker-compose.yml, checked by the real Compose v2 (no Docker engine is needed to validate it)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_tools import COMPOSE_FILE, REPO, compose_command, parse_cli, run

from prefixgrove.settings import PlannerSettings, WorkerSettings, load


def compose(
    *args: str, file: Path = COMPOSE_FILE, check: bool = True
) -> subprocess.CompletedProcess[str]:
    # a fixed project directory, and no .env of the developer's leaking into the result
    cmd = [*compose_command(), "-f", str(file), "--project-directory", str(file.parent),
           "--env-file", "/dev/null", *args]  # fmt: skip
    return run(cmd, check=check, env={"COMPOSE_PROFILES": ""})


def resolved(*profiles: str) -> dict[str, Any]:
    flags = [arg for p in profiles for arg in ("--profile", p)]
    return yaml.safe_load(compose(*flags, "config").stdout)


def test_compose_file_is_valid() -> None:
    assert compose("config", "-q").returncode == 0


def test_a_broken_compose_file_is_refused(tmp_path: Path) -> None:
    # proves the validator is the real one: the PyPI wrapper would exit 0 here
    text = COMPOSE_FILE.read_text().replace(
        "condition: service_healthy", "condition: when_ready", 1
    )
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text)
    done = compose("config", "-q", file=broken, check=False)
    assert done.returncode != 0
    assert "services.planner.depends_on.redis.condition" in done.stderr


def test_default_stack_is_redis_planner_and_a_cpu_worker() -> None:
    services = resolved()["services"]
    assert sorted(services) == ["planner", "redis", "worker"]
    worker = services["worker"]["command"]
    assert worker[worker.index("--device") + 1] == "cpu"
    assert worker[worker.index("--model") + 1] == "tiny-random-llama"
    assert "deploy" not in services["worker"]


def test_the_planner_serves_the_model_of_every_worker() -> None:
    services = resolved("gpu")["services"]
    planner = load(PlannerSettings, parse_cli(services["planner"]["command"]),
                   env=services["planner"]["environment"])  # fmt: skip
    served = [model.name for model in planner.models]
    for worker in ("worker", "worker-gpu"):
        command = services[worker]["command"]
        assert command[command.index("--model") + 1] in served, (worker, served)
    assert served[0] == "tiny-random-llama"  # a job that names no model runs on the CPU worker


def test_every_service_has_a_healthcheck_and_waits_for_its_dependencies() -> None:
    services = resolved("gpu")["services"]
    for name, service in services.items():
        assert service["healthcheck"]["test"], name
    assert services["planner"]["depends_on"]["redis"]["condition"] == "service_healthy"
    for worker in ("worker", "worker-gpu"):
        assert services[worker]["depends_on"]["planner"]["condition"] == "service_healthy"


def test_gpu_profile_adds_a_worker_reserving_an_nvidia_device() -> None:
    services = resolved("gpu")["services"]
    gpu = services["worker-gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["command"][gpu["command"].index("--device") + 1] == "cuda"
    assert gpu["build"]["dockerfile"] == "docker/worker.Dockerfile"


def test_gpu_worker_keeps_compiled_kernels_on_a_named_volume() -> None:
    config = resolved("gpu")
    mounts = config["services"]["worker-gpu"]["volumes"]
    cache = next(m for m in mounts if m["target"] == "/tmp/triton")  # the image's TRITON_CACHE_DIR
    assert cache["type"] == "volume" and cache["source"] in config["volumes"]


def test_redis_keeps_an_append_only_file_on_a_volume_behind_a_password() -> None:
    config = resolved()
    redis = config["services"]["redis"]
    cmd = redis["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    password = cmd[cmd.index("--requirepass") + 1]
    assert {"type": "volume", "source": "redis-data", "target": "/data", "volume": {}} in redis[
        "volumes"
    ]
    assert "redis-data" in config["volumes"]
    url = config["services"]["planner"]["environment"]["PREFIXGROVE_REDIS_URL"]
    assert url == f"redis://:{password}@redis:6379/0"


def test_cli_has_the_data_folder_for_input_and_output() -> None:
    cli = resolved("cli")["services"]["cli"]
    bind = next(v for v in cli["volumes"] if v["target"] == "/data")
    assert bind["type"] == "bind" and bind["source"] == str(REPO / "data")


@pytest.mark.parametrize(
    ("service", "settings"), [("planner", PlannerSettings), ("worker", WorkerSettings)]
)
def test_service_commands_are_what_the_services_read(service: str, settings: type) -> None:
    spec = resolved()["services"][service]
    assert spec["command"][:2] == ["serve", service]
    loaded = load(settings, parse_cli(spec["command"]), env=spec["environment"])
    assert loaded.redis_url.endswith("@redis:6379/0")
    assert loaded.metrics_port in (9090, 9091)


def test_submit_shown_in_the_compose_file_is_a_valid_cli_command() -> None:
    header = [line.lstrip("# ").rstrip() for line in COMPOSE_FILE.read_text().splitlines()]
    start = next(
        i for i, line in enumerate(header) if line.startswith("docker compose run --rm cli")
    )
    command = header[start].removesuffix("\\") + " " + header[start + 1]
    args = parse_cli(command.split("docker compose run --rm cli", 1)[1].split())
    assert (args.planner, args.wait) == ("planner:50051", True)
    assert str(args.output).startswith("/data/") and str(args.errors).startswith("/data/")


def test_the_planner_is_published_on_this_machine_only() -> None:
    ports = resolved()["services"]["planner"]["ports"]
    published = [p for p in ports if p["target"] == 50051]
    assert published and all(p.get("host_ip") == "127.0.0.1" for p in published), ports
