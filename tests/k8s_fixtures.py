"""A real etcd + kube-apiserver for tests, started on free loopback ports with token auth and RBAC.

Import the fixtures into a conftest.py. Binaries come from `scripts/ci/build-kube-apiserver.sh` (cached under
~/.cache/prefixgrove/k8s-1.20.2/bin, or $PREFIXGROVE_K8S_BIN) and Debian's etcd-server. When one is missing
the tests skip locally and FAIL when CI=true, so CI can never pass without the API server.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from ports import free_port

REPO = Path(__file__).resolve().parents[1]
START_SCRIPT = REPO / "scripts" / "ci" / "start-kube-apiserver.sh"
DEFAULT_BIN = Path.home() / ".cache" / "prefixgrove" / "k8s-1.20.2" / "bin"
# where scripts/ci/install-helm.sh puts a kubectl, tried after $PREFIXGROVE_KUBECTL and PATH
HELM_KUBECTL = Path.home() / ".cache" / "prefixgrove" / "helm-3.17" / "bin" / "kubectl"


def missing(reason: str) -> None:
    """Skip locally; fail in CI, where a missing test bed must never look like a pass."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: the Kubernetes test bed is required)", pytrace=False)
    pytest.skip(reason)


def find_kubectl() -> str | None:
    explicit = os.environ.get("PREFIXGROVE_KUBECTL")
    if explicit:
        return explicit if Path(explicit).exists() else None
    return shutil.which("kubectl") or (str(HELM_KUBECTL) if HELM_KUBECTL.exists() else None)


@dataclass(frozen=True)
class KubeApi:
    kubeconfig: Path
    run_dir: Path

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        """Runs kubectl against this API server and returns stdout; raises with stderr on failure."""
        kubectl = find_kubectl() or "kubectl"
        done = subprocess.run(
            [kubectl, "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout


def _alive(pid: int) -> bool:
    """Whether the process runs. A daemon's parent is init, which may reap it seconds after it
    exited: a zombie counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _stop(run_dir: Path) -> None:
    """Kills the two daemons by the pids the start script wrote, apiserver first: their state goes
    with run_dir, so they need no graceful stop."""
    for name in ("apiserver.pid", "etcd.pid"):
        pid_file = run_dir / name
        if not pid_file.exists():
            continue
        pid = int(pid_file.read_text().strip())
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)


@pytest.fixture(scope="session")
def kube_api() -> Iterator[KubeApi]:
    """etcd + kube-apiserver for the whole session; yields their kubeconfig and a kubectl helper."""
    bin_dir = Path(os.environ.get("PREFIXGROVE_K8S_BIN", DEFAULT_BIN))
    if not (bin_dir / "kube-apiserver").exists():
        missing(f"no kube-apiserver in {bin_dir}; run scripts/ci/build-kube-apiserver.sh")
    if shutil.which("etcd") is None:
        missing("no etcd on PATH; apt-get install -y etcd-server")
    kubectl = find_kubectl()
    if kubectl is None:
        missing("no kubectl on PATH; apt-get install -y kubernetes-client")
    run_dir = Path(tempfile.mkdtemp(prefix="prefixgrove-k8s-"))
    env = {
        **os.environ,
        "K8S_RUN_DIR": str(run_dir),
        "K8S_BIN": str(bin_dir),
        "ETCD_PORT": str(free_port()),
        "ETCD_PEER_PORT": str(free_port()),
        "API_PORT": str(free_port()),
        "KUBECTL": str(kubectl),
    }
    try:
        done = subprocess.run(
            ["bash", str(START_SCRIPT)], env=env, capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            pytest.fail(f"kube-apiserver did not start:\n{done.stderr}", pytrace=False)
        yield KubeApi(kubeconfig=Path(done.stdout.strip().splitlines()[-1]), run_dir=run_dir)
    finally:
        _stop(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
