"""Real components for the operator tests: the API server with the BatchJob CRD, Redis, the planner,
a CPU worker, and the operator itself running in-process under kopf's KopfRunner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s_fixtures import REPO, KubeApi, find_kubectl, free_port
from polling import terminate, wait_for
from services_testbed import RedisServer, need_redis

CRD = REPO / "helm" / "prefixgrove" / "crds" / "batchjobs.yaml"
MODEL = "tiny-random-llama"
NAMESPACE = "default"
WORKER_DEPLOYMENT = "prefixgrove-worker"
GROUPS_PER_WORKER = 1
MIN_WORKERS = 1
MAX_WORKERS = 10
SCALE_DOWN_WINDOW_S = 6.0
AUTOSCALE_INTERVAL_S = 0.5
UNSERVED_WARNING_S = 1.0


class Service:
    """A child process of the tests, stopped by its own pid; its output is kept for failures."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log = log_dir / f"{name}-{uuid.uuid4().hex[:6]}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        terminate(self.proc)


def cli(*args: str) -> list[str]:
    """The project's `prefixgrove` command, run by this interpreter."""
    return [sys.executable, "-m", "prefixgrove.cli", *args]


class BatchJobs:
    """kubectl on BatchJobs, as a person would use it."""

    def __init__(self, kube: KubeApi, namespace: str = NAMESPACE) -> None:
        self.kube = kube
        self.namespace = namespace

    def apply(self, name: str, spec: dict[str, Any]) -> None:
        body = {
            "apiVersion": "prefixgrove.io/v1alpha1",
            "kind": "BatchJob",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": spec,
        }
        self.kube.kubectl("apply", "-f", "-", input=json.dumps(body))

    def get(self, name: str) -> dict[str, Any] | None:
        out = self.kube.kubectl("get", "bj", name, "-n", self.namespace, "-o", "json", check=False)
        return json.loads(out) if out.strip() else None

    def status(self, name: str) -> dict[str, Any]:
        return (self.get(name) or {}).get("status") or {}

    def delete(self, name: str, timeout: float = 30.0) -> None:
        """Deletes the BatchJob and waits until it is gone, i.e. until the operator has handled the
        deletion and removed its finalizer. Polled here rather than by kubectl's own wait, which once
        hung past its 60 s although the operator's log showed the deletion handled."""
        self.kube.kubectl("delete", "bj", name, "-n", self.namespace, "--wait=false")
        wait_for(f"BatchJob {name} to be gone", lambda: self.get(name) is None, timeout)

    def wait_phase(self, name: str, *phases: str, timeout: float = 60.0) -> dict[str, Any]:
        return wait_for(
            f"BatchJob {name} to reach {phases}",
            lambda: (s := self.status(name)).get("phase") in phases and s,
            timeout,
        )

    def patch(self, name: str, spec: dict[str, Any]) -> None:
        self.kube.kubectl(
            "patch", "bj", name, "-n", self.namespace, "--type=merge", "-p",
            json.dumps({"spec": spec}),
        )  # fmt: skip

    def events(self, name: str) -> list[str]:
        out = self.kube.kubectl(
            "get", "events", "-n", self.namespace, "-o", "json",
            f"--field-selector=involvedObject.name={name}",
        )  # fmt: skip
        return [event["reason"] for event in json.loads(out)["items"]]

    def warnings(self, name: str) -> dict[str, str]:
        """The Warning Events of a BatchJob: reason -> message."""
        out = self.kube.kubectl(
            "get", "events", "-n", self.namespace, "-o", "json",
            f"--field-selector=involvedObject.name={name},type=Warning",
        )  # fmt: skip
        return {event["reason"]: event["message"] for event in json.loads(out)["items"]}


class PhaseWatch:
    """`kubectl get bj -w --output-watch-events -o json` on one BatchJob, as a person would watch
    it; records every version the API server sends, from before the BatchJob exists."""

    def __init__(self, kube: KubeApi, name: str, log_dir: Path) -> None:
        self.out = log_dir / f"watch-{name}.json"
        kubectl = find_kubectl() or "kubectl"
        args = [
            kubectl, "--kubeconfig", str(kube.kubeconfig), "get", "bj", "-n", NAMESPACE,
            f"--field-selector=metadata.name={name}", "-w", "--output-watch-events", "-o", "json",
        ]  # fmt: skip
        errors = log_dir / f"watch-{name}.stderr"
        with self.out.open("wb") as out, errors.open("wb") as err:
            self.proc = subprocess.Popen(args, stdout=out, stderr=err)

    def __enter__(self) -> PhaseWatch:
        return self

    def __exit__(self, *_: object) -> None:
        terminate(self.proc)

    def events(self) -> list[dict[str, Any]]:
        """The watch events so far: {"type": ADDED | MODIFIED | DELETED, "object": ...}."""
        text, events, decoder, at = self.out.read_text(), [], json.JSONDecoder(), 0
        while (at := _skip_space(text, at)) < len(text):
            try:
                event, at = decoder.raw_decode(text, at)
            except ValueError:
                break  # a version still being written
            events.append(event)
        return events

    def phases(self) -> list[str]:
        """Each phase the BatchJob showed, in order, a phase repeated only after another."""
        seen: list[str] = []
        for event in self.events():
            phase = (event["object"].get("status") or {}).get("phase")
            if phase and (not seen or seen[-1] != phase):
                seen.append(phase)
        return seen


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


@pytest.fixture(scope="session")
def crd(kube_api: KubeApi) -> KubeApi:
    """The chart's BatchJob CRD, applied and established."""
    if not CRD.exists():
        pytest.fail(f"the BatchJob CRD is missing at {CRD}", pytrace=False)
    kube_api.kubectl("apply", "-f", str(CRD))
    kube_api.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/batchjobs.prefixgrove.io"
    )
    return kube_api


@pytest.fixture(scope="session")
def batchjobs(crd: KubeApi) -> BatchJobs:
    return BatchJobs(crd)


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def volume(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared data volume: BatchJob input and output paths live under it."""
    return tmp_path_factory.mktemp("volume")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(need_redis(), tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.kill()


def _service_env(redis_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGROVE_")}
    return {**env, "PREFIXGROVE_REDIS_URL": redis_url, "PREFIXGROVE_MODEL": MODEL}


def start_planner(
    redis_url: str,
    logs_dir: Path,
    token: str = "",
    tls: dict[str, str] | None = None,
    port: int | None = None,
) -> tuple[Service, str]:
    """A real planner process on a free port, answering calls; returns it and its address.
    `tls` holds the planner's PEM files: cert, key and (for clients) ca."""
    from prefixgrove.planner.client import PlannerClient, PlannerUnavailable
    from prefixgrove.settings import SecuritySettings

    port = port or free_port()
    args = cli("serve", "planner", "--host", "127.0.0.1", "--port", str(port))
    env = _service_env(redis_url)
    if token:
        env["PREFIXGROVE_AUTH_TOKEN"] = token
    if tls:
        env.update(PREFIXGROVE_TLS_CERT=tls["cert"], PREFIXGROVE_TLS_KEY=tls["key"])
    server = Service("planner", args, env, logs_dir)
    address = f"127.0.0.1:{port}"
    security = SecuritySettings(auth_token=token or None, tls_ca=tls["ca"] if tls else None)
    client = PlannerClient(address, security, timeout_s=2.0)

    def ready() -> bool:
        if not server.alive():
            pytest.fail(f"the planner exited:\n{server.tail()}", pytrace=False)
        try:
            client.queue_depth()
        except PlannerUnavailable:
            return False
        return True

    try:
        wait_for("the planner to answer", ready, timeout=60, every=0.5)
    except BaseException:
        server.stop()
        raise
    finally:
        client.close()
    return server, address


@pytest.fixture(scope="session")
def planner_address(redis_url: str, logs_dir: Path) -> Iterator[str]:
    """The session's planner, over the session's Redis."""
    server, address = start_planner(redis_url, logs_dir)
    yield address
    server.stop()


@pytest.fixture(scope="session")
def planner(planner_address: str) -> Iterator[Any]:
    """A client of the test planner, to check what the operator did."""
    from prefixgrove.planner.client import PlannerClient

    client = PlannerClient(planner_address)
    yield client
    client.close()


def start_worker(redis_url: str, logs_dir: Path) -> Service:
    """A real worker process on the CPU serving the tiny model."""
    worker = Service(
        "worker", cli("serve", "worker", "--device", "cpu"), _service_env(redis_url), logs_dir
    )
    time.sleep(1.0)
    if not worker.alive():
        pytest.fail(f"the worker exited:\n{worker.tail()}", pytrace=False)
    return worker


@pytest.fixture(scope="module")
def cpu_worker(redis_url: str, planner_address: str, logs_dir: Path) -> Iterator[Service]:
    """A CPU worker for one test module."""
    worker = start_worker(redis_url, logs_dir)
    yield worker
    worker.stop()


@pytest.fixture(scope="session")
def operator_env(crd: KubeApi, planner_address: str, volume: Path) -> Iterator[None]:
    """The operator's settings, set before its module is first imported (it reads them then)."""
    env = {
        "KUBECONFIG": str(crd.kubeconfig),
        "PREFIXGROVE_PLANNER_ADDRESS": planner_address,
        "PREFIXGROVE_SHARED_VOLUME_ROOT": str(volume),
        "PREFIXGROVE_STATUS_INTERVAL_S": "0.5",
        "PREFIXGROVE_RETRY_DELAY_S": "1",
        "PREFIXGROVE_UNSERVED_WARNING_S": str(UNSERVED_WARNING_S),
        "PREFIXGROVE_WORKER_DEPLOYMENT": WORKER_DEPLOYMENT,
        "PREFIXGROVE_WORKER_NAMESPACE": NAMESPACE,
        "PREFIXGROVE_GROUPS_PER_WORKER": str(GROUPS_PER_WORKER),
        "PREFIXGROVE_MIN_WORKERS": str(MIN_WORKERS),
        "PREFIXGROVE_MAX_WORKERS": str(MAX_WORKERS),
        "PREFIXGROVE_AUTOSCALE_INTERVAL_S": str(AUTOSCALE_INTERVAL_S),
        "PREFIXGROVE_SCALE_DOWN_WINDOW_S": str(SCALE_DOWN_WINDOW_S),
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    import prefixgrove_operator.handlers as handlers

    assert handlers.SETTINGS.planner_address == planner_address, "handlers imported too early"
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def apply_worker_deployment(kube: KubeApi, name: str, replicas: int) -> None:
    """A worker Deployment in NAMESPACE, for an autoscaler to drive (its pods never run: there is
    no kubelet)."""
    body = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "worker", "image": "prefixgrove-worker:test"}]},
            },
        },
    }
    kube.kubectl("apply", "-f", "-", input=json.dumps(body))


@pytest.fixture(scope="session")
def worker_deployment(crd: KubeApi) -> str:
    """The worker Deployment the operator's autoscaler drives."""
    apply_worker_deployment(crd, WORKER_DEPLOYMENT, MIN_WORKERS)
    return WORKER_DEPLOYMENT


# `kopf run` arguments for the operator under test, in this process
OPERATOR_ARGS = [
    "run",
    "--standalone",
    f"--namespace={NAMESPACE}",
    "-m",
    "prefixgrove_operator.handlers",
]


def replicas(kube: KubeApi, deployment: str = WORKER_DEPLOYMENT) -> int:
    out = kube.kubectl(
        "get", "deployment", deployment, "-n", NAMESPACE, "-o", "jsonpath={.spec.replicas}"
    )
    return int(out)


@pytest.fixture
def operator(operator_env: None, worker_deployment: str) -> Iterator[Any]:
    """The operator, in-process, for one test."""
    from kopf.testing import KopfRunner

    with KopfRunner(OPERATOR_ARGS, timeout=60) as runner:
        yield runner
