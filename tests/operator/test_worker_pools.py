"""Worker pools: PREFIXGROVE_WORKER_POOLS parsed and checked, and one autoscaler per pool, each
scaling its own Deployment (on a real API server) from its own model's queue depth."""

from __future__ import annotations

import uuid

import pytest
from k8s_fixtures import KubeApi
from kubernetes import client, config
from operator_testbed import NAMESPACE, apply_worker_deployment, replicas

from prefixgrove_operator.autoscaler import pool_autoscalers
from prefixgrove_operator.settings import OperatorSettings, WorkerPool


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("w-llama=llama", [("w-llama", "llama", 0, 8, 4)]),
        ("w-llama=llama:1:3", [("w-llama", "llama", 1, 3, 4)]),
        (
            " w-llama=llama:0:4:2 , w-qwen=qwen:2:6:1 ",
            [("w-llama", "llama", 0, 4, 2), ("w-qwen", "qwen", 2, 6, 1)],
        ),
        # a model name may hold ':'; the numbers are always the last fields
        ("w=llama3:8b", [("w", "llama3:8b", 0, 8, 4)]),
        ("w=llama3:8b:1:2", [("w", "llama3:8b", 1, 2, 4)]),
        ("w=qwen:7:0:5:3", [("w", "qwen:7", 0, 5, 3)]),
        ("w=org/Model-1.5B:0:1:1", [("w", "org/Model-1.5B", 0, 1, 1)]),
    ],
)
def test_worker_pools_parse_with_the_single_settings_as_defaults(
    value: str, expected: list[tuple[str, str, int, int, int]]
) -> None:
    settings = OperatorSettings.from_env(
        {"PREFIXGROVE_WORKER_POOLS": value, "PREFIXGROVE_WORKER_DEPLOYMENT": "ignored"}
    )
    assert [
        (p.deployment, p.model, p.min_workers, p.max_workers, p.groups_per_worker)
        for p in settings.pools
    ] == expected
    assert settings.autoscaling


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("w-llama", "worker pool 'w-llama' is invalid: expected DEPLOYMENT=MODEL"),
        ("=llama", "worker pool '=llama' is invalid"),
        ("w-llama=", "worker pool 'w-llama=' is invalid"),
        ("w llama=llama", "worker pool 'w llama=llama' is invalid"),
        ("w-llama=llama:2", "worker pool 'w-llama=llama:2' is invalid: .*MIN and MAX go together"),
        ("w-llama=llama:3:2", "worker pool 'w-llama=llama:3:2' is invalid: .*max_workers=2, min"),
        ("w-llama=llama:0:0", "worker pool 'w-llama=llama:0:0' is invalid: .*max_workers >= 1"),
        ("w-llama=llama:0:2:0", "'w-llama=llama:0:2:0' is invalid: groups_per_worker must be >= 1"),
        ("w=llama:0:-2", r"'w=llama:0:-2' is invalid: .*max_workers=-2"),
        ("ok=a, w-llama=llama:9", "worker pool 'w-llama=llama:9' is invalid"),
        ("w=llama,w=qwen", "deployment 'w' is in two pools"),
        ("w1=llama,w2=llama", "model 'llama' is in two pools"),
    ],
)
def test_a_bad_worker_pool_is_refused_naming_the_entry(value: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        OperatorSettings.from_env({"PREFIXGROVE_WORKER_POOLS": value})


def test_without_pools_the_single_deployment_settings_apply() -> None:
    settings = OperatorSettings.from_env(
        {
            "PREFIXGROVE_WORKER_DEPLOYMENT": "workers",
            "PREFIXGROVE_WORKER_MODEL": "llama",
            "PREFIXGROVE_MIN_WORKERS": "1",
            "PREFIXGROVE_MAX_WORKERS": "3",
            "PREFIXGROVE_GROUPS_PER_WORKER": "2",
            "PREFIXGROVE_WORKER_POOLS": "",
        }
    )
    assert settings.pools == (WorkerPool("workers", "llama", 1, 3, 2),)
    off = OperatorSettings.from_env({"PREFIXGROVE_WORKER_DEPLOYMENT": ""})
    assert off.pools == () and not off.autoscaling


def test_each_pool_scales_from_its_own_models_queue(kube_api: KubeApi) -> None:
    suffix = uuid.uuid4().hex[:6]
    llama, qwen = f"w-llama-{suffix}", f"w-qwen-{suffix}"
    apply_worker_deployment(kube_api, llama, replicas=0)
    apply_worker_deployment(kube_api, qwen, replicas=2)  # left running from earlier work
    window_s = 60.0
    settings = OperatorSettings(
        worker_namespace=NAMESPACE,
        scale_down_window_s=window_s,
        worker_pools=f"{llama}=llama:0:5:2,{qwen}=qwen:0:3:1",
    )
    depths = {"llama": 7, "qwen": 0}
    asked: list[str] = []

    def queue_depth(model: str) -> int:
        asked.append(model)
        return depths[model]

    now = [1000.0]
    apps = client.AppsV1Api(config.new_client_from_config(config_file=str(kube_api.kubeconfig)))
    autoscalers = pool_autoscalers(settings, queue_depth, apps, clock=lambda: now[0])
    assert [(a.scaler.name, a.pool.model) for a in autoscalers] == [
        (llama, "llama"),
        (qwen, "qwen"),
    ]

    def step_all() -> None:
        for autoscaler in autoscalers:
            autoscaler.step()

    step_all()
    assert sorted(set(asked)) == ["llama", "qwen"]
    # llama's 7 groups at 2 a worker: 4 workers, up at once; qwen's empty queue leaves it alone
    # within the window (its running count is its first recommendation)
    assert (replicas(kube_api, llama), replicas(kube_api, qwen)) == (4, 2)

    depths["llama"] = 20  # beyond llama's maximum; still nothing for qwen
    now[0] += window_s + 1
    step_all()
    assert (replicas(kube_api, llama), replicas(kube_api, qwen)) == (5, 0)

    depths.update(llama=0, qwen=2)  # qwen's queue fills: only qwen's pool grows
    now[0] += 1
    step_all()
    assert (replicas(kube_api, llama), replicas(kube_api, qwen)) == (5, 2)

    now[0] += window_s + 1  # llama's queue stayed empty a whole window: down to zero
    step_all()
    assert (replicas(kube_api, llama), replicas(kube_api, qwen)) == (0, 2)
