"""What `helm template` renders: the resources the issue asks for, wired to the settings the services
and the operator really read."""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any, TypeVar

import pytest
from deploy_tools import CHART, container, env_of, find, helm, kinds, parse_cli, template

from prefixgrove.engine_settings import EngineSettings
from prefixgrove.planner.metrics import PlannerMetrics
from prefixgrove.settings import PlannerSettings, SecuritySettings, WorkerSettings, load
from prefixgrove.worker.metrics import WorkerMetrics
from prefixgrove_operator.settings import OperatorSettings

PREFIX = "t-prefixgrove"
T = TypeVar("T")


def test_default_install_renders_every_component() -> None:
    objects = template()
    assert kinds(objects) == sorted(
        ["ClusterRole", "ClusterRoleBinding", "Deployment", "Deployment", "Deployment",
         "PersistentVolumeClaim", "Role", "RoleBinding", "Secret", "Service", "Service", "Service",
         "ServiceAccount", "StatefulSet"]
    )  # fmt: skip
    names = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
    assert names == {f"{PREFIX}-planner", f"{PREFIX}-worker", f"{PREFIX}-operator"}


def test_each_template_file_holds_one_resource() -> None:
    out = helm("template", "t", str(CHART), "--set", "metrics.grafanaDashboard.enabled=true",
               "--set", "planner.podDisruptionBudget.enabled=true").stdout  # fmt: skip
    sources = Counter(re.findall(r"^# Source: (\S+)$", out, flags=re.M))
    assert sources, "nothing rendered"
    assert max(sources.values()) == 1, sources


def test_worker_runs_on_gpu_nodes_with_a_gpu_limit_and_the_model_volume() -> None:
    objects = template(
        "--set", "worker.modelVolume.type=persistentVolumeClaim",
        "--set", "worker.modelVolume.claimName=llama-weights",
        "--set", "worker.gpus=2",
    )  # fmt: skip
    worker = find(objects, "Deployment", f"{PREFIX}-worker")
    pod = worker["spec"]["template"]["spec"]
    c = container(worker, "worker")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    assert models["persistentVolumeClaim"] == {"claimName": "llama-weights", "readOnly": True}
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]


def test_workers_keep_compiled_kernels_on_the_node_when_asked() -> None:
    objects = template(
        "--set", "worker.kernelCache.type=hostPath",
        "--set", "worker.kernelCache.hostPath=/var/lib/prefixgrove/triton",
    )  # fmt: skip
    worker = find(objects, "Deployment", f"{PREFIX}-worker")
    c = container(worker, "worker")
    volumes = {v["name"]: v for v in worker["spec"]["template"]["spec"]["volumes"]}
    assert volumes["kernel-cache"]["hostPath"] == {
        "path": "/var/lib/prefixgrove/triton",
        "type": "Directory",
    }
    mount = next(m for m in c["volumeMounts"] if m["name"] == "kernel-cache")
    assert env_of(c)["TRITON_CACHE_DIR"] == mount["mountPath"]


def test_workers_compile_into_their_own_tmp_by_default() -> None:
    worker = find(template(), "Deployment", f"{PREFIX}-worker")
    c = container(worker, "worker")
    assert "TRITON_CACHE_DIR" not in env_of(c)  # the image's /tmp/triton, on the pod's emptyDir
    assert all(v["name"] != "kernel-cache" for v in worker["spec"]["template"]["spec"]["volumes"])


def test_a_cpu_trial_is_a_worker_any_node_can_schedule() -> None:
    """worker.device=cpu alone: no GPU limit, no GPU node selector or toleration, and requests
    sized for a CPU (worker.cpu.*), not for a GPU node."""
    worker = find(template("--set", "worker.device=cpu"), "Deployment", f"{PREFIX}-worker")
    pod = worker["spec"]["template"]["spec"]
    c = container(worker, "worker")
    assert c["args"][c["args"].index("--device") + 1] == "cpu"
    assert "nvidia.com/gpu" not in json.dumps(worker)
    assert c["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}
    assert "nodeSelector" not in pod and "tolerations" not in pod


def test_autoscaled_workers_leave_replicas_to_the_operator() -> None:
    scaled = find(template(), "Deployment", f"{PREFIX}-worker")
    fixed = find(template("--set", "autoscaling.enabled=false", "--set", "worker.replicas=3"),
                 "Deployment", f"{PREFIX}-worker")  # fmt: skip
    assert "replicas" not in scaled["spec"]
    assert fixed["spec"]["replicas"] == 3


def settings_read(kind: type[T], c: dict[str, Any]) -> T:
    """The `kind` of settings a service reads from its container's flags and its Redis URL."""
    redis_url = env_of(c)["PREFIXGROVE_REDIS_URL"]
    return load(kind, parse_cli(c["args"]), env={"PREFIXGROVE_REDIS_URL": redis_url})


def test_planner_flags_and_env_are_what_the_planner_reads() -> None:
    objects = template("--set", "auth.enabled=true")
    c = container(find(objects, "Deployment", f"{PREFIX}-planner"), "planner")
    assert c["args"][:2] == ["serve", "planner"]
    env = env_of(c)
    settings = settings_read(PlannerSettings, c)
    assert settings.port == 50051 and settings.metrics_port == 9090
    assert settings.model == "tiny-random-llama"
    assert settings.redis_url == f"redis://:$(REDIS_PASSWORD)@{PREFIX}-redis:6379/0"
    assert env["REDIS_PASSWORD"]["secretKeyRef"] == {
        "name": f"{PREFIX}-redis",
        "key": "redis-password",
    }
    assert env["PREFIXGROVE_AUTH_TOKEN"]["secretKeyRef"] == {
        "name": f"{PREFIX}-auth",
        "key": "token",
    }
    service = find(objects, "Service", f"{PREFIX}-planner")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": 50051,
        "metrics": 9090,
    }


def test_the_planner_keeps_its_files_in_the_bucket_of_files_url() -> None:
    objects = template(
        "--set", "planner.httpPort=8000", "--set", "planner.filesUrl=s3://evals/files"
    )
    c = container(find(objects, "Deployment", f"{PREFIX}-planner"), "planner")
    assert settings_read(PlannerSettings, c).files_url == "s3://evals/files"


def test_worker_flags_are_what_the_worker_reads() -> None:
    c = container(find(template(), "Deployment", f"{PREFIX}-worker"), "worker")
    assert c["args"][:2] == ["serve", "worker"]
    settings = settings_read(WorkerSettings, c)
    engine = load(EngineSettings, parse_cli(c["args"]), env={})
    assert (settings.model, engine.device, settings.metrics_port) == (
        "tiny-random-llama",
        "cuda",
        9091,
    )
    assert env_of(c)["PREFIXGROVE_CONSUMER"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_operator_env_builds_valid_settings_pointing_at_the_chart_objects() -> None:
    objects = template(
        "--set", "autoscaling.minReplicas=1", "--set", "autoscaling.maxReplicas=5",
        "--set", "autoscaling.groupsPerWorker=3", "--set", "autoscaling.scaleDownStabilizationSeconds=120",
    )  # fmt: skip
    c = container(find(objects, "Deployment", f"{PREFIX}-operator"), "operator")
    plain = {
        k: v for k, v in env_of(c).items() if k.startswith("PREFIXGROVE_") and isinstance(v, str)
    }
    settings = OperatorSettings.from_env(plain)
    assert settings.planner_address == f"{PREFIX}-planner.prefixgrove.svc:50051"
    assert settings.worker_deployment == f"{PREFIX}-worker"
    assert settings.worker_namespace == "prefixgrove"
    assert settings.worker_model == "tiny-random-llama"
    assert (settings.min_workers, settings.max_workers, settings.groups_per_worker) == (1, 5, 3)
    assert settings.scale_down_window_s == 120
    assert settings.shared_volume_root == "/data"
    assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]
    assert "--namespace=prefixgrove" in c["command"] and "--standalone" in c["command"]


def test_tls_serves_the_planner_from_the_secret_and_the_operator_trusts_its_ca() -> None:
    objects = template(
        "--set", "tls.enabled=true", "--set", "tls.secretName=planner-tls",
        "--set", "tls.mutual=true", "--set", "tls.clientSecretName=operator-tls",
        "--kube-version", "1.29.0",
    )  # fmt: skip
    planner = find(objects, "Deployment", f"{PREFIX}-planner")
    c = container(planner, "planner")
    settings = load(SecuritySettings, parse_cli(c["args"]), env={})
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in planner["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "planner-tls"
    assert settings.tls_cert == f"{mounts['tls']}/tls.crt"
    assert settings.tls_key == f"{mounts['tls']}/tls.key"
    assert settings.tls_ca == f"{mounts['tls']}/ca.crt"  # mutual: client certificates required
    # No kubelet's gRPC probe speaks TLS: readiness falls back to the TCP port.
    assert c["readinessProbe"]["tcpSocket"] == {"port": "grpc"}

    operator = find(objects, "Deployment", f"{PREFIX}-operator")
    o = container(operator, "operator")
    env = {k: v for k, v in env_of(o).items() if k.startswith("PREFIXGROVE_")}
    op = OperatorSettings.from_env({k: v for k, v in env.items() if isinstance(v, str)})
    o_mounts = {m["name"]: m["mountPath"] for m in o["volumeMounts"]}
    o_volumes = {v["name"]: v for v in operator["spec"]["template"]["spec"]["volumes"]}
    assert op.planner_tls_ca == f"{o_mounts['planner-ca']}/ca.crt"
    assert o_volumes["planner-ca"]["secret"]["secretName"] == "planner-tls"
    assert [i["key"] for i in o_volumes["planner-ca"]["secret"]["items"]] == ["ca.crt"]
    assert op.planner_tls_client_cert == f"{o_mounts['client-tls']}/tls.crt"
    assert op.planner_tls_client_key == f"{o_mounts['client-tls']}/tls.key"
    assert o_volumes["client-tls"]["secret"]["secretName"] == "operator-tls"


def test_without_tls_nothing_mounts_certificates() -> None:
    objects = template("--kube-version", "1.29.0")
    for name, kind in (("planner", "planner"), ("operator", "operator")):
        c = container(find(objects, "Deployment", f"{PREFIX}-{name}"), kind)
        assert not [a for a in c.get("args", []) if a.startswith("--tls")]
        assert not [k for k in env_of(c) if "TLS" in k]
    planner = container(find(objects, "Deployment", f"{PREFIX}-planner"), "planner")
    assert planner["readinessProbe"]["grpc"] == {"port": 50051}


def test_operator_without_autoscaling_gets_no_deployment_rights() -> None:
    objects = template("--set", "autoscaling.enabled=false")
    c = container(find(objects, "Deployment", f"{PREFIX}-operator"), "operator")
    assert (
        OperatorSettings.from_env(
            {"PREFIXGROVE_WORKER_DEPLOYMENT": env_of(c)["PREFIXGROVE_WORKER_DEPLOYMENT"]}
        ).autoscaling
        is False
    )
    rules = find(objects, "Role")["rules"]
    assert not any("apps" in r["apiGroups"] for r in rules)


def _grants(rules: list[dict]) -> set[tuple[str, str, str, str]]:
    return {
        (group, resource, verb, ",".join(r.get("resourceNames", [])))
        for r in rules
        for group in r["apiGroups"]
        for resource in r["resources"]
        for verb in r["verbs"]
    }


BATCHJOB_GRANTS = {
    ("prefixgrove.io", "batchjobs", "get", ""),
    ("prefixgrove.io", "batchjobs", "list", ""),
    ("prefixgrove.io", "batchjobs", "watch", ""),
    ("prefixgrove.io", "batchjobs", "patch", ""),
    ("prefixgrove.io", "batchjobs/status", "get", ""),
    ("prefixgrove.io", "batchjobs/status", "patch", ""),
    ("prefixgrove.io", "batchjobs/finalizers", "update", ""),
    ("", "configmaps", "get", ""),
    ("", "events", "create", ""),
}
SCALE_GRANTS = {
    ("apps", "deployments", "get", f"{PREFIX}-worker"),
    ("apps", "deployments/scale", "get", f"{PREFIX}-worker"),
    ("apps", "deployments/scale", "patch", f"{PREFIX}-worker"),
}
# kopf lists the namespaces it was told to watch before it watches anything in them
NAMESPACE_GRANTS = {("", "namespaces", "list", ""), ("", "namespaces", "watch", "")}
CRD_GRANTS = {
    ("apiextensions.k8s.io", "customresourcedefinitions", "list", ""),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch", ""),
}


@pytest.mark.parametrize("scope", ["namespace", "cluster"])
def test_operator_rbac_is_exactly_what_it_needs(scope: str) -> None:
    objects = template("--set", f"operator.watchScope={scope}")
    role = _grants(find(objects, "Role")["rules"])
    cluster_role = _grants(find(objects, "ClusterRole")["rules"])
    if scope == "namespace":
        assert role == SCALE_GRANTS | BATCHJOB_GRANTS
        assert cluster_role == CRD_GRANTS | NAMESPACE_GRANTS
    else:
        assert role == SCALE_GRANTS
        assert cluster_role == CRD_GRANTS | BATCHJOB_GRANTS
    binding = find(objects, "RoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{PREFIX}-operator", "namespace": "prefixgrove"}
    ]
    # two releases of one name in two namespaces must not share a ClusterRole
    assert find(objects, "ClusterRole")["metadata"]["name"] == f"prefixgrove-{PREFIX}-operator"


def test_the_operator_reads_only_the_credentials_secrets_the_values_name() -> None:
    objects = template("--set", "operator.credentialsSecrets={bucket-creds,other-creds}")
    role = _grants(find(objects, "Role")["rules"])
    assert role == SCALE_GRANTS | BATCHJOB_GRANTS | {
        ("", "secrets", "get", "bucket-creds,other-creds")
    }


def test_planner_and_worker_get_no_api_credentials() -> None:
    objects = template()
    for name in ("planner", "worker"):
        pod = find(objects, "Deployment", f"{PREFIX}-{name}")["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False


def test_bundled_redis_persists_with_aof_behind_a_password() -> None:
    objects = template("--set", "redis.appendfsync=always")
    redis = find(objects, "StatefulSet", f"{PREFIX}-redis")
    c = container(redis, "redis")
    args = c["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "always"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert env_of(c)["REDIS_PASSWORD"]["secretKeyRef"]["name"] == f"{PREFIX}-redis"
    claim = redis["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "redis-data"
    assert {"name": "redis-data", "mountPath": "/data"} in c["volumeMounts"]
    secret = find(objects, "Secret", f"{PREFIX}-redis")
    assert len(secret["data"]["redis-password"]) > 20


def test_external_redis_replaces_the_bundled_one() -> None:
    objects = template(
        "--set", "redis.enabled=false", "--set", "redis.external.existingSecret=my-redis",
    )  # fmt: skip
    assert "StatefulSet" not in kinds(objects)
    for name in ("planner", "worker"):
        env = env_of(container(find(objects, "Deployment", f"{PREFIX}-{name}"), name))
        assert env["PREFIXGROVE_REDIS_URL"] == {
            "secretKeyRef": {"name": "my-redis", "key": "redis-url"}
        }
        assert "REDIS_PASSWORD" not in env


def test_pod_disruption_budget_uses_policy_v1_where_served() -> None:
    on = ["--set", "planner.podDisruptionBudget.enabled=true"]
    assert find(template(*on), "PodDisruptionBudget")["apiVersion"] == "policy/v1"
    assert "PodDisruptionBudget" not in kinds(template())


def test_planner_probe_uses_grpc_only_where_kubelets_have_it() -> None:
    new = container(
        find(template("--kube-version", "1.29.0"), "Deployment", f"{PREFIX}-planner"), "planner"
    )
    old = container(
        find(template("--kube-version", "1.20.2"), "Deployment", f"{PREFIX}-planner"), "planner"
    )
    assert new["readinessProbe"]["grpc"] == {"port": 50051}
    assert old["readinessProbe"]["tcpSocket"] == {"port": "grpc"}


def test_service_monitors_need_and_use_the_prometheus_operator_api() -> None:
    objects = template(
        "--set", "metrics.serviceMonitor.enabled=true", "--api-versions", "monitoring.coreos.com/v1",
    )  # fmt: skip
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert sorted(m["metadata"]["name"] for m in monitors) == [
        f"{PREFIX}-planner",
        f"{PREFIX}-worker",
    ]
    worker_metrics = find(objects, "Service", f"{PREFIX}-worker-metrics")
    monitor = find(objects, "ServiceMonitor", f"{PREFIX}-worker")
    labels = worker_metrics["metadata"]["labels"]
    assert all(labels[k] == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    assert worker_metrics["spec"]["ports"][0]["name"] == monitor["spec"]["endpoints"][0]["port"]


def test_grafana_dashboard_is_valid_json_on_metrics_the_services_export() -> None:
    objects = template("--set", "metrics.grafanaDashboard.enabled=true")
    dashboard = json.loads(find(objects, "ConfigMap")["data"]["prefixgrove.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"\b(prefixgrove_\w+)", e)}
    planner = PlannerMetrics()
    planner.declare_models(["m"])  # the series of each served model exist from the start
    registries = [planner.registry, WorkerMetrics(model="m").registry]
    exported = {s.name for r in registries for metric in r.collect() for s in metric.samples}
    assert len(names) >= 8
    assert names <= exported, names - exported
