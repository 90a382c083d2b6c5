"""The chart against a real kube-apiserver (v1.20, from tests/k8s_fixtures.py): the CRD, server-side
dry runs of everything the chart renders, a real `helm install`, upgrade and uninstall, and RBAC as
the API server's own authorizer decides it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_tools import CHART, CRD, helm, kubectl, kubectl_path, run
from k8s_fixtures import KubeApi

PREFIX = "pg-prefixgrove"


@pytest.fixture(scope="module")
def api(kube_api: KubeApi) -> KubeApi:
    """The API server with the BatchJob CRD established."""
    kubectl(kube_api, "apply", "-f", str(CRD))
    kubectl(kube_api, "wait", "--for=condition=Established", "--timeout=60s",
            "crd/batchjobs.prefixgrove.io")  # fmt: skip
    return kube_api


def install(api: KubeApi, namespace: str, *args: str) -> str:
    return helm(
        "install", "pg", str(CHART), "--namespace", namespace, "--wait=false", *args,
        kubeconfig=api.kubeconfig,
    ).stdout  # fmt: skip


def server_version(api: KubeApi) -> str:
    return json.loads(kubectl(api, "version", "-o", "json"))["serverVersion"]["gitVersion"]


def test_crd_serves_batchjobs_with_short_name_and_printer_columns(api: KubeApi) -> None:
    resources = kubectl(api, "api-resources", "--api-group=prefixgrove.io", "-o", "wide")
    assert re.search(
        r"^batchjobs\s+bj\s+prefixgrove.io/v1alpha1\s+true\s+BatchJob", resources, re.M
    )
    crd = json.loads(kubectl(api, "get", "crd", "batchjobs.prefixgrove.io", "-o", "json"))
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert {"Phase", "Progress", "Age"} <= set(columns)


def test_rendered_chart_passes_server_side_dry_run(api: KubeApi, namespace: str) -> None:
    # --validate renders with the server's own capabilities (v1.20: policy/v1beta1, no gRPC probes)
    out = helm(
        "template", "pg", str(CHART), "--namespace", namespace, "--validate",
        "--set", "planner.podDisruptionBudget.enabled=true", "--set", "auth.enabled=true",
        "--set", "metrics.grafanaDashboard.enabled=true",
        "--set", "tls.enabled=true", "--set", "tls.secretName=planner-tls",
        "--set", "tls.mutual=true", "--set", "tls.clientSecretName=operator-tls",
        kubeconfig=api.kubeconfig,
    ).stdout  # fmt: skip
    objects = [o for o in yaml.safe_load_all(out) if o]
    pdb = next(o for o in objects if o["kind"] == "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1beta1"
    applied = kubectl(api, "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=out)
    assert applied.count("(server dry run)") == len(objects)


def test_cluster_scoped_operator_passes_server_side_dry_run(api: KubeApi, namespace: str) -> None:
    out = helm(
        "template", "pg", str(CHART), "--namespace", namespace,
        "--kube-version", server_version(api).lstrip("v"),
        "--set", "operator.watchScope=cluster", "--set", "redis.enabled=false",
        "--set", "redis.external.url=redis://redis.example:6379/0",
        "--set", "worker.device=cpu", "--set", "worker.gpus=0",
    ).stdout  # fmt: skip
    applied = kubectl(api, "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=out)
    assert "clusterrole.rbac.authorization.k8s.io" in applied


def _get(api: KubeApi, namespace: str, kind: str, name: str) -> dict[str, Any]:
    return json.loads(kubectl(api, "get", kind, name, "-n", namespace, "-o", "json"))


def test_helm_install_creates_the_release_and_its_objects(api: KubeApi, namespace: str) -> None:
    notes = install(api, namespace)
    assert "STATUS: deployed" in notes
    status = json.loads(
        helm("status", "pg", "-n", namespace, "-o", "json", kubeconfig=api.kubeconfig).stdout
    )
    assert status["info"]["status"] == "deployed"
    for kind, name in [
        ("deployment", f"{PREFIX}-planner"),
        ("deployment", f"{PREFIX}-worker"),
        ("deployment", f"{PREFIX}-operator"),
        ("statefulset", f"{PREFIX}-redis"),
        ("service", f"{PREFIX}-planner"),
        ("secret", f"{PREFIX}-redis"),
        ("serviceaccount", f"{PREFIX}-operator"),
        ("role", f"{PREFIX}-operator"),
        ("pvc", f"{PREFIX}-data"),
    ]:
        assert _get(api, namespace, kind, name)["metadata"]["name"] == name
    worker = _get(api, namespace, "deployment", f"{PREFIX}-worker")
    limits = worker["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1"


def test_example_batchjob_in_notes_is_accepted_and_listed(api: KubeApi, namespace: str) -> None:
    notes = install(api, namespace)
    block = notes.split("<<'YAML' | kubectl apply", 1)[1].split("\n", 1)[1].split("  YAML", 1)[0]
    example = yaml.safe_load("\n".join(line[2:] for line in block.splitlines()))
    assert example["kind"] == "BatchJob"
    kubectl(api, "apply", "-n", namespace, "-f", "-", input=json.dumps(example))
    listed = kubectl(api, "get", "bj", "-n", namespace)
    assert re.match(r"NAME\s+PHASE\s+PROGRESS\s+COMPLETED\s+FAILED\s+TOTAL\s+ETA\s+AGE", listed)
    assert "hello" in listed


def test_generated_redis_password_survives_an_upgrade(api: KubeApi, namespace: str) -> None:
    install(api, namespace)
    before = _get(api, namespace, "secret", f"{PREFIX}-redis")["data"]["redis-password"]
    helm("upgrade", "pg", str(CHART), "-n", namespace, "--set", "planner.replicas=2",
         kubeconfig=api.kubeconfig)  # fmt: skip
    after = _get(api, namespace, "secret", f"{PREFIX}-redis")["data"]["redis-password"]
    assert after == before
    assert _get(api, namespace, "deployment", f"{PREFIX}-planner")["spec"]["replicas"] == 2


def test_upgrade_keeps_the_replicas_the_autoscaler_set(api: KubeApi, namespace: str) -> None:
    install(api, namespace)
    kubectl(api, "scale", "deployment", f"{PREFIX}-worker", "-n", namespace, "--replicas=5")
    helm("upgrade", "pg", str(CHART), "-n", namespace, "--set", "autoscaling.maxReplicas=6",
         kubeconfig=api.kubeconfig)  # fmt: skip
    assert _get(api, namespace, "deployment", f"{PREFIX}-worker")["spec"]["replicas"] == 5


def test_uninstall_removes_the_release_but_keeps_job_data(api: KubeApi, namespace: str) -> None:
    install(api, namespace)
    helm("uninstall", "pg", "-n", namespace, kubeconfig=api.kubeconfig)
    assert kubectl(api, "get", "deployments", "-n", namespace, "-o", "name") == ""
    assert kubectl(api, "get", "pvc", f"{PREFIX}-data", "-n", namespace, "-o", "name").strip()


def can(api: KubeApi, namespace: str, *what: str) -> bool:
    sa = f"system:serviceaccount:{namespace}:{PREFIX}-operator"
    out = kubectl(api, "auth", "can-i", *what, "-n", namespace, "--as", sa, check=False)
    return out.strip() == "yes"


def test_operator_service_account_can_do_its_job_and_nothing_more(
    api: KubeApi, namespace: str
) -> None:
    install(api, namespace)
    worker = f"deployments.apps/{PREFIX}-worker"
    allowed = [
        ("watch", "batchjobs.prefixgrove.io"),
        ("patch", "batchjobs.prefixgrove.io"),
        ("patch", "batchjobs.prefixgrove.io/x", "--subresource=status"),
        ("create", "events"),
        ("get", "configmaps/questions"),
        ("get", worker),
        ("patch", worker, "--subresource=scale"),
    ]
    denied = [
        ("create", "batchjobs.prefixgrove.io"),
        ("delete", "batchjobs.prefixgrove.io/x"),
        ("patch", worker),
        ("patch", f"deployments.apps/{PREFIX}-planner", "--subresource=scale"),
        ("delete", worker),
        ("create", "pods"),
        ("get", "secrets"),
        ("list", "configmaps"),
    ]
    assert [a for a in allowed if not can(api, namespace, *a)] == []
    assert [d for d in denied if can(api, namespace, *d)] == []
    # namespace scope: BatchJobs elsewhere are none of its business
    sa = f"system:serviceaccount:{namespace}:{PREFIX}-operator"
    out = kubectl(api, "auth", "can-i", "watch", "batchjobs.prefixgrove.io", "-n", "default",
                  "--as", sa, check=False)  # fmt: skip
    assert out.strip() == "no"


def test_two_releases_of_one_name_coexist_in_two_namespaces(api: KubeApi, namespace: str) -> None:
    other = f"{namespace}-b"
    kubectl(api, "create", "namespace", other)
    try:
        install(api, namespace, "--set", "operator.watchScope=cluster")
        install(api, other, "--set", "operator.watchScope=cluster")
        roles = kubectl(api, "get", "clusterroles", "-o", "name")
        assert f"clusterrole.rbac.authorization.k8s.io/{namespace}-{PREFIX}-operator" in roles
        assert f"clusterrole.rbac.authorization.k8s.io/{other}-{PREFIX}-operator" in roles
        sa = f"system:serviceaccount:{other}:{PREFIX}-operator"
        out = kubectl(api, "auth", "can-i", "watch", "batchjobs.prefixgrove.io", "-A",
                      "--as", sa, check=False)  # fmt: skip
        assert out.strip() == "yes"
    finally:
        helm("uninstall", "pg", "-n", other, kubeconfig=api.kubeconfig, check=False)
        kubectl(api, "delete", "namespace", other, "--wait=false", check=False)


def _write(tmp_path: Path, body: dict[str, Any]) -> Path:
    path = tmp_path / "bj.json"
    path.write_text(json.dumps(body))
    return path


VALID_INPUTS = {
    "inline": {"inline": [{"custom_id": "a", "url": "/v1/chat/completions",
                           "body": {"messages": [{"role": "user", "content": "hi"}]}}]},
    "configMap": {"configMap": {"name": "questions", "key": "in.jsonl"}},
    "path": {"path": "jobs/2026-11/in.jsonl"},
}  # fmt: skip


@pytest.mark.parametrize("source", list(VALID_INPUTS))
def test_crd_accepts_each_input_source(api: KubeApi, namespace: str, source: str) -> None:
    body = {
        "apiVersion": "prefixgrove.io/v1alpha1",
        "kind": "BatchJob",
        "metadata": {"name": f"ok-{source.lower()}"},
        "spec": {
            "model": "tiny-random-llama",
            "input": VALID_INPUTS[source],
            "output": {"path": "jobs/out.jsonl", "errorsPath": "jobs/errors.jsonl"},
            "sampling": {"maxTokens": 16, "temperature": 0.7, "topP": 0.9, "topK": 40,
                         "minP": 0.05, "seed": 7, "stop": ["\n"], "ignoreEos": False, "logprobs": 2},
        },
    }  # fmt: skip
    kubectl(api, "apply", "-n", namespace, "-f", "-", input=json.dumps(body))
    stored = json.loads(
        kubectl(api, "get", "bj", body["metadata"]["name"], "-n", namespace, "-o", "json")
    )
    assert stored["spec"] == body["spec"]


ESCAPES = [
    "/etc/passwd",
    "../secrets.jsonl",
    "a/../../b",
    "a/./b",
    ".hidden/in.jsonl",
    "a//b",
    "a/",
]


@pytest.mark.parametrize("path", ESCAPES)
def test_crd_rejects_paths_that_leave_the_shared_volume(
    api: KubeApi, namespace: str, path: str
) -> None:
    body = {
        "apiVersion": "prefixgrove.io/v1alpha1",
        "kind": "BatchJob",
        "metadata": {"name": "escape"},
        "spec": {"model": "m", "input": {"path": "in.jsonl"}, "output": {"path": path}},
    }
    done = run(
        [kubectl_path(), "--kubeconfig", str(api.kubeconfig), "apply", "-n", namespace, "-f", "-"],
        input=json.dumps(body),
        check=False,
    )
    assert done.returncode != 0
    assert "spec.output.path" in done.stderr
