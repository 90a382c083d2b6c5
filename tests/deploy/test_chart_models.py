"""The chart's `models`: one worker Deployment per model, the planner serving every model, the operator
scaling each pool from its own model's queue, and the planner's files on the data volume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_tools import (
    CHART,
    container,
    env_of,
    find,
    helm,
    kubectl,
    parse_cli,
    template,
)
from k8s_fixtures import KubeApi

from prefixgrove.engine_settings import EngineSettings
from prefixgrove.settings import PlannerSettings, ServedModel, WorkerSettings, load
from prefixgrove_operator.settings import OperatorSettings, WorkerPool

PREFIX = "t-prefixgrove"
MODELS = [
    {"name": "llama", "source": "/models/llama-3.1-8b"},
    {
        "name": "Qwen2.5_7B",
        "source": "/models/qwen2.5-7b",
        "minReplicas": 1,
        "maxReplicas": 2,
        "groupsPerWorker": 6,
        "gpus": 2,
        "extraArgs": ["--dtype", "bfloat16"],
        "nodeSelector": {"gpu": "h200"},
        "tolerations": [],
    },
]
LLAMA, QWEN = f"{PREFIX}-worker-llama", f"{PREFIX}-worker-qwen2-5-7b"
MODEL_NAMES = ("llama", "trial", "pinned")


def render(tmp_path: Path, values: dict[str, Any], *args: str) -> list[dict[str, Any]]:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return template("-f", str(path), *args)


def refusal(tmp_path: Path, values: dict[str, Any]) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    done = helm("template", "t", str(CHART), "-f", str(path), check=False)
    assert done.returncode != 0, f"{values} was accepted"
    return done.stderr


def worker_settings(deployment: dict[str, Any]) -> WorkerSettings:
    c = container(deployment, "worker")
    env = {"PREFIXGROVE_REDIS_URL": env_of(c)["PREFIXGROVE_REDIS_URL"]}
    return load(WorkerSettings, parse_cli(c["args"]), env=env)


def engine_settings(deployment: dict[str, Any]) -> EngineSettings:
    return load(EngineSettings, parse_cli(container(deployment, "worker")["args"]), env={})


def test_each_model_gets_its_own_worker_deployment(tmp_path: Path) -> None:
    objects = render(tmp_path, {"models": MODELS})
    workers = [
        o
        for o in objects
        if o["kind"] == "Deployment"
        and o["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    ]
    assert sorted(o["metadata"]["name"] for o in workers) == [LLAMA, QWEN]

    llama, qwen = find(objects, "Deployment", LLAMA), find(objects, "Deployment", QWEN)
    s, engine = worker_settings(llama), engine_settings(llama)
    assert (s.model, s.served_name, engine.device) == ("/models/llama-3.1-8b", "llama", "cuda")
    s, engine = worker_settings(qwen), engine_settings(qwen)
    assert (s.model, s.served_name, engine.dtype) == (
        "/models/qwen2.5-7b", "Qwen2.5_7B", "bfloat16"
    )  # fmt: skip

    # overrides replace the worker.* value; what an entry leaves out comes from worker.*
    llama_pod, qwen_pod = (d["spec"]["template"]["spec"] for d in (llama, qwen))
    assert container(llama, "worker")["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container(qwen, "worker")["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container(qwen, "worker")["resources"]["requests"] == {"cpu": "4", "memory": "32Gi"}
    assert llama_pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert qwen_pod["nodeSelector"] == {"gpu": "h200"}
    assert llama_pod["tolerations"] and "tolerations" not in qwen_pod
    assert all("replicas" not in d["spec"] for d in workers)  # the operator owns them

    # two pools never select each other's pods; the metrics Service selects every pool's pods
    selectors = [d["spec"]["selector"]["matchLabels"] for d in workers]
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in workers]
    for i, selector in enumerate(selectors):
        for j, labels in enumerate(pod_labels):
            assert (selector.items() <= labels.items()) == (i == j)
    metrics = find(objects, "Service", f"{PREFIX}-worker-metrics")["spec"]["selector"]
    assert all(metrics.items() <= labels.items() for labels in pod_labels)


def test_without_autoscaling_each_pool_has_its_replicas(tmp_path: Path) -> None:
    models = [{**MODELS[0], "replicas": 3}, MODELS[1]]
    objects = render(
        tmp_path,
        {"models": models, "autoscaling": {"enabled": False}, "worker": {"replicas": 2}},
    )
    assert find(objects, "Deployment", LLAMA)["spec"]["replicas"] == 3
    assert find(objects, "Deployment", QWEN)["spec"]["replicas"] == 2
    operator = container(find(objects, "Deployment", f"{PREFIX}-operator"), "operator")
    plain = {k: v for k, v in env_of(operator).items() if isinstance(v, str)}
    assert not OperatorSettings.from_env(plain).autoscaling
    assert not any("apps" in r["apiGroups"] for r in find(objects, "Role")["rules"])


def test_the_planner_serves_every_model_the_first_by_default(tmp_path: Path) -> None:
    objects = render(tmp_path, {"models": MODELS})
    c = container(find(objects, "Deployment", f"{PREFIX}-planner"), "planner")
    assert "--model" in c["args"]
    assert "llama=/models/llama-3.1-8b" in c["args"]
    assert "Qwen2.5_7B=/models/qwen2.5-7b" in c["args"]
    settings = load(PlannerSettings, parse_cli(c["args"]), env={})
    assert settings.models == (
        ServedModel("llama", "/models/llama-3.1-8b"),
        ServedModel("Qwen2.5_7B", "/models/qwen2.5-7b"),
    )


def test_planner_default_model_names_one_of_the_models(tmp_path: Path) -> None:
    objects = render(tmp_path, {"models": MODELS, "planner": {"defaultModel": "Qwen2.5_7B"}})
    c = container(find(objects, "Deployment", f"{PREFIX}-planner"), "planner")
    settings = load(PlannerSettings, parse_cli(c["args"]), env={})
    assert [m.name for m in settings.models] == ["Qwen2.5_7B", "llama"]
    stderr = refusal(tmp_path, {"models": MODELS, "planner": {"defaultModel": "mistral"}})
    assert 'planner.defaultModel "mistral" is none of the models\' names' in stderr


def test_the_operator_scales_each_pool_from_its_models_queue(tmp_path: Path) -> None:
    objects = render(
        tmp_path, {"models": MODELS, "autoscaling": {"minReplicas": 0, "maxReplicas": 5}}
    )
    c = container(find(objects, "Deployment", f"{PREFIX}-operator"), "operator")
    env = env_of(c)
    assert env["PREFIXGROVE_WORKER_POOLS"] == (f"{LLAMA}=llama:0:5:4,{QWEN}=Qwen2.5_7B:1:2:6")
    settings = OperatorSettings.from_env(
        {k: v for k, v in env.items() if k.startswith("PREFIXGROVE_") and isinstance(v, str)}
    )
    assert settings.pools == (
        WorkerPool(LLAMA, "llama", 0, 5, 4),
        WorkerPool(QWEN, "Qwen2.5_7B", 1, 2, 6),
    )
    assert settings.worker_namespace == "prefixgrove"
    # it may read and scale every pool's Deployment, and no other
    grants = {
        (resource, verb, name)
        for r in find(objects, "Role")["rules"]
        if "apps" in r["apiGroups"]
        for resource in r["resources"]
        for verb in r["verbs"]
        for name in r["resourceNames"]
    }
    assert grants == {
        (resource, verb, name)
        for name in (LLAMA, QWEN)
        for resource, verb in (
            ("deployments", "get"),
            ("deployments/scale", "get"),
            ("deployments/scale", "patch"),
        )
    }


@pytest.mark.parametrize(
    ("models", "complaint"),
    [
        (
            [{"name": "llama", "source": "/a"}, {"name": "llama", "source": "/b"}],
            'models[1].name "llama" is a duplicate',
        ),
        (
            [{"name": "Llama.3", "source": "/a"}, {"name": "llama-3", "source": "/b"}],
            f'"Llama.3" and "llama-3" both become the worker Deployment {PREFIX}-worker-llama-3',
        ),
        ([{"name": "___", "source": "/a"}], 'models[0].name "___" can\'t form a DNS label'),
        ([{"name": "m" * 50, "source": "/a"}], "longer than 63 characters"),
        ([{"name": "a,b", "source": "/a"}], "models.0.name"),
        ([{"name": "llama"}], "source is required"),
        (
            [{"name": "llama", "source": "/a", "minReplicas": 3, "maxReplicas": 2}],
            "models[0].maxReplicas (2) must be >= models[0].minReplicas (3)",
        ),
        (
            [{"name": "llama", "source": "/a", "gpus": 0}],
            "models[0].device is cuda but models[0].gpus is 0",
        ),
        ([{"name": "llama", "source": "/a", "gpu": 1}], "Additional property gpu is not allowed"),
        (
            [{"name": "llama", "source": "/a", "device": "cpu", "gpus": 2}],
            "models[0].device is cpu but models[0].gpus is 2",
        ),
    ],
)
def test_bad_models_are_refused_naming_the_entry(
    tmp_path: Path, models: list[dict[str, Any]], complaint: str
) -> None:
    assert complaint in refusal(tmp_path, {"models": models})


def test_a_cpu_pool_beside_gpu_pools_asks_for_no_gpu_node(tmp_path: Path) -> None:
    trial = {"name": "trial", "source": "tiny-random-llama", "device": "cpu"}
    pinned = {**trial, "name": "pinned", "nodeSelector": {"pool": "cpu"}}
    objects = render(tmp_path, {"models": [MODELS[0], trial, pinned]})
    gpu, cpu, own = (find(objects, "Deployment", f"{PREFIX}-worker-{n}") for n in MODEL_NAMES)
    assert "nvidia.com/gpu" not in json.dumps(cpu)
    assert container(cpu, "worker")["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}
    assert not {"nodeSelector", "tolerations"} & set(cpu["spec"]["template"]["spec"])
    # what a CPU entry sets itself is kept; the GPU pool keeps the GPU nodes' settings
    assert own["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert gpu["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert container(gpu, "worker")["resources"]["limits"] == {"nvidia.com/gpu": 1}


def test_models_pass_helm_lint_strict(tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"models": MODELS, "planner": {"httpPort": 8000}}))
    done = helm("lint", "--strict", str(CHART), "-f", str(path))
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


def _planner(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], PlannerSettings, dict]:
    planner = find(objects, "Deployment", f"{PREFIX}-planner")
    c = container(planner, "planner")
    volumes = {v["name"]: v for v in planner["spec"]["template"]["spec"]["volumes"]}
    return c, load(PlannerSettings, parse_cli(c["args"]), env={}), volumes


def test_the_planner_keeps_uploaded_files_on_the_data_claim(tmp_path: Path) -> None:
    objects = render(tmp_path, {"planner": {"httpPort": 8000, "replicas": 3}})
    c, settings, volumes = _planner(objects)
    claim = find(objects, "PersistentVolumeClaim", f"{PREFIX}-data")["metadata"]["name"]
    assert volumes["data"] == {"name": "data", "persistentVolumeClaim": {"claimName": claim}}
    assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]
    assert settings.data_dir == "/data"
    assert settings.files_dir.parent == Path("/data")
    # the operator mounts the same volume at the same path
    operator = find(objects, "Deployment", f"{PREFIX}-operator")
    o_volumes = {v["name"]: v for v in operator["spec"]["template"]["spec"]["volumes"]}
    assert o_volumes["data"] == volumes["data"]

    objects = render(tmp_path, {"planner": {"httpPort": 8000}, "data": {"existingClaim": "shared"}})
    c, settings, volumes = _planner(objects)
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "shared"}
    assert settings.data_dir == "/data"


@pytest.mark.parametrize(
    "values",
    [
        {"planner": {"httpPort": 0}},  # no HTTP API: no files
        {"planner": {"httpPort": 8000}, "data": {"persistence": {"enabled": False}}},  # no claim
    ],
    ids=["no http api", "no claim"],
)
def test_without_a_claim_or_http_api_the_planner_mounts_no_data(
    tmp_path: Path, values: dict[str, Any]
) -> None:
    c, settings, volumes = _planner(render(tmp_path, values))
    assert "data" not in volumes
    assert all(m["name"] != "data" for m in c["volumeMounts"])
    assert settings.data_dir == ""


def test_installed_pools_are_what_the_operator_may_scale(
    kube_api: KubeApi, namespace: str, tmp_path: Path
) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"models": MODELS, "planner": {"httpPort": 8000}}))
    out = helm("template", "pg", str(CHART), "-n", namespace, "-f", str(path), "--validate",
               kubeconfig=kube_api.kubeconfig).stdout  # fmt: skip
    objects = [o for o in yaml.safe_load_all(out) if o]
    applied = kubectl(kube_api, "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=out)
    assert applied.count("(server dry run)") == len(objects)

    helm("install", "pg", str(CHART), "-n", namespace, "-f", str(path), "--wait=false",
         kubeconfig=kube_api.kubeconfig)  # fmt: skip
    listed = json.loads(kubectl(kube_api, "get", "deployments", "-n", namespace, "-o", "json"))
    names = {d["metadata"]["name"] for d in listed["items"]}
    pools = {"pg-prefixgrove-worker-llama", "pg-prefixgrove-worker-qwen2-5-7b"}
    assert names == pools | {"pg-prefixgrove-planner", "pg-prefixgrove-operator"}
    sa = f"system:serviceaccount:{namespace}:pg-prefixgrove-operator"

    def can(*what: str) -> bool:
        answer = kubectl(kube_api, "auth", "can-i", *what, "-n", namespace, "--as", sa, check=False)
        return answer.strip() == "yes"

    for pool in pools:
        assert can("get", f"deployments.apps/{pool}")
        assert can("patch", f"deployments.apps/{pool}", "--subresource=scale")
        assert not can("patch", f"deployments.apps/{pool}")
    assert not can("patch", "deployments.apps/pg-prefixgrove-planner", "--subresource=scale")
    assert not can("patch", "deployments.apps/pg-prefixgrove-worker", "--subresource=scale")


def test_fp8_is_set_for_every_pool_or_per_pool(tmp_path: Path) -> None:
    models = [MODELS[0], {**MODELS[1], "quantization": "", "kvCacheDtype": "fp8"}]
    objects = render(tmp_path, {"models": models, "worker": {"quantization": "fp8"}})
    llama = engine_settings(find(objects, "Deployment", LLAMA))
    qwen = engine_settings(find(objects, "Deployment", QWEN))
    assert (llama.quantization, llama.kv_cache_dtype) == ("fp8", "auto")
    assert (qwen.quantization, qwen.kv_cache_dtype) == (None, "fp8")
    # the defaults leave both off
    plain = engine_settings(find(render(tmp_path, {}), "Deployment", f"{PREFIX}-worker"))
    assert (plain.quantization, plain.kv_cache_dtype) == (None, "auto")
    assert "kvCacheDtype" in refusal(tmp_path, {"worker": {"kvCacheDtype": "int8"}})


def test_a_pool_of_several_gpus_runs_one_engine_across_them(tmp_path: Path) -> None:
    objects = render(tmp_path, {"models": MODELS, "worker": {"gpus": 1}})
    qwen = find(objects, "Deployment", QWEN)
    assert engine_settings(qwen).tensor_parallel_size == 2  # the pool's gpus: 2
    assert container(qwen, "worker")["resources"]["limits"]["nvidia.com/gpu"] == 2
    # one GPU: no flag, the worker's own default (every GPU it was given) is that one
    assert engine_settings(find(objects, "Deployment", LLAMA)).tensor_parallel_size is None
    four = render(tmp_path, {"worker": {"gpus": 4}})
    assert engine_settings(find(four, "Deployment", f"{PREFIX}-worker")).tensor_parallel_size == 4
    cpu = render(tmp_path, {"worker": {"gpus": 2, "device": "cpu"}})
    assert engine_settings(find(cpu, "Deployment", f"{PREFIX}-worker")).tensor_parallel_size is None
