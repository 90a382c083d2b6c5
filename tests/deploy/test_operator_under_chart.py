"""The real operator, started with the command and settings the chart gives its Deployment and
authenticated as the chart's ServiceAccount, does its whole job against a real API server, planner
and Redis: the chart's least-privilege RBAC is enough, and nothing it does is forbidden."""

from __future__ import annotations

import json
import os
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_tools import CHART, CRD, VENV_BIN, Process, helm, kubectl
from k8s_fixtures import KubeApi, free_port
from polling import wait_for

RELEASE = "pg"
PREFIX = f"{RELEASE}-prefixgrove"


class Cluster:
    def __init__(self, api: KubeApi, namespace: str) -> None:
        self.api = api
        self.namespace = namespace

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        return kubectl(self.api, "-n", self.namespace, *args, input=input, check=check)

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        out = self.kubectl("get", kind, name, "-o", "json", "--ignore-not-found")
        return json.loads(out) if out.strip() else None


@pytest.fixture(scope="module")
def cluster(kube_api: KubeApi) -> Iterator[Cluster]:
    """The chart installed in a fresh namespace: quick autoscaling so a test sees it act."""
    namespace = f"op-{uuid.uuid4().hex[:8]}"
    kube_api.kubectl("create", "namespace", namespace)
    helm(
        "install", RELEASE, str(CHART), "--namespace", namespace, "--wait=false",
        "--set", "autoscaling.intervalSeconds=1",
        "--set", "autoscaling.scaleDownStabilizationSeconds=0",
        "--set", "operator.statusIntervalSeconds=1",
        kubeconfig=kube_api.kubeconfig,
    )  # fmt: skip
    kube_api.kubectl("wait", "--for=condition=Established", "crd/batchjobs.prefixgrove.io")
    assert CRD.exists()
    yield Cluster(kube_api, namespace)
    kube_api.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture(scope="module")
def service_account_kubeconfig(cluster: Cluster, logs: Path) -> Path:
    """A kubeconfig carrying a token of the operator's ServiceAccount, nothing more."""
    token = cluster.kubectl("create", "token", f"{PREFIX}-operator").strip()
    server = yaml.safe_load(cluster.api.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "c", "cluster": {"server": server, "insecure-skip-tls-verify": True}}
        ],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "operator"}}],
        "current-context": "c",
    }
    path = logs / "operator-kubeconfig"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def operator(
    cluster: Cluster, service_account_kubeconfig: Path, planner_address: str, logs: Path
) -> Iterator[tuple[Process, int]]:
    """`kopf run ...` exactly as the chart's Deployment says, with its env; only what a pod gets
    from the cluster (the planner's Service DNS name, the data volume, the port) is replaced."""
    deployment = cluster.get("deployment", f"{PREFIX}-operator")
    assert deployment is not None
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    health_port = free_port()
    command = [
        arg.replace("0.0.0.0:8080", f"127.0.0.1:{health_port}") for arg in container["command"]
    ]
    assert command[0] == "kopf"
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["PREFIXGROVE_PLANNER_ADDRESS"] == f"{PREFIX}-planner.{cluster.namespace}.svc:50051"
    volume = logs / "data"
    volume.mkdir()
    env.update(
        PREFIXGROVE_PLANNER_ADDRESS=planner_address,
        PREFIXGROVE_SHARED_VOLUME_ROOT=str(volume),
        HOME=str(logs),
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFIXGROVE_", "KUBE"))}
    process = Process.start(
        "operator",
        [str(VENV_BIN / "kopf"), *command[1:]],
        {**base, **env, "KUBECONFIG": str(service_account_kubeconfig)},
        logs,
    )
    yield process, health_port
    process.stop()


def assert_nothing_forbidden(process: Process) -> None:
    log = process.text()
    assert "forbidden" not in log.lower(), log[-3000:]


def _healthy(process: Process, port: int) -> bool:
    process.check_alive()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


def test_operator_starts_and_answers_its_liveness_probe(operator: tuple[Process, int]) -> None:
    wait_for("the operator's /healthz", lambda: _healthy(*operator), timeout=60)
    assert_nothing_forbidden(operator[0])


def test_autoscaler_scales_the_worker_deployment_to_its_minimum(
    cluster: Cluster, operator: tuple[Process, int]
) -> None:
    # the chart leaves replicas unset (1); an empty queue with minReplicas 0 scales it to zero
    def replicas() -> int | None:
        deployment = cluster.get("deployment", f"{PREFIX}-worker")
        return None if deployment is None else deployment["spec"].get("replicas")

    wait_for("the worker Deployment at 0 replicas", lambda: replicas() == 0, timeout=60)
    assert_nothing_forbidden(operator[0])


def _batchjob(name: str, source: dict[str, Any]) -> str:
    return json.dumps({
        "apiVersion": "prefixgrove.io/v1alpha1",
        "kind": "BatchJob",
        "metadata": {"name": name},
        "spec": {"model": "tiny-random-llama", "input": source, "output": {"path": f"{name}/out.jsonl"}},
    })  # fmt: skip


def test_batchjob_with_a_missing_configmap_fails_with_a_condition_and_an_event(
    cluster: Cluster, operator: tuple[Process, int]
) -> None:
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=_batchjob("no-input", {"configMap": {"name": "absent", "key": "k"}}),
    )
    job = wait_for(
        "the BatchJob to fail",
        lambda: (
            (j := cluster.get("bj", "no-input"))
            and j.get("status", {}).get("phase") == "Failed"
            and j
        ),
    )
    condition = job["status"]["conditions"][-1]
    assert (condition["type"], condition["reason"]) == ("Failed", "InputNotFound")
    assert "absent" in condition["message"]
    events = json.loads(cluster.kubectl("get", "events", "-o", "json"))["items"]
    assert any(e["reason"] == "InputNotFound" and e["type"] == "Warning" for e in events)
    assert_nothing_forbidden(operator[0])


def test_batchjob_is_submitted_and_deleting_it_cancels_the_planner_job(
    cluster: Cluster, operator: tuple[Process, int], planner_address: str
) -> None:
    from prefixgrove.planner.client import PlannerClient
    from prefixgrove_proto import planner_pb2 as pb

    requests = [
        {
            "custom_id": f"q{i}",
            "url": "/v1/completions",
            "body": {"prompt": f"question {i}", "max_tokens": 4},
        }
        for i in range(3)
    ]
    cluster.kubectl("apply", "-f", "-", input=_batchjob("submitted", {"inline": requests}))
    job = wait_for(
        "the planner job id in status",
        lambda: (j := cluster.get("bj", "submitted")) and j.get("status", {}).get("jobId") and j,
    )
    assert job["status"]["requestCounts"]["total"] == 3
    assert "prefixgrove.io/cancel-job" in job["metadata"]["finalizers"]
    cluster.kubectl("delete", "bj", "submitted", "--wait=false")
    wait_for("the BatchJob to be gone", lambda: cluster.get("bj", "submitted") is None)
    client = PlannerClient(planner_address)
    try:
        state = client.get(job["status"]["jobId"]).state
        assert state in (pb.JOB_STATE_CANCELLING, pb.JOB_STATE_CANCELLED)
    finally:
        client.close()
    assert_nothing_forbidden(operator[0])
