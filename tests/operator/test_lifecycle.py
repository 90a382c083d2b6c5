"""BatchJobs run end to end: kubectl -> operator -> planner -> a CPU worker -> results on the volume."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from k8s_fixtures import KubeApi
from kubernetes import client, config
from operator_testbed import (
    MODEL,
    NAMESPACE,
    OPERATOR_ARGS,
    BatchJobs,
    Service,
)
from polling import wait_for

from prefixgrove.planner.client import PlannerClient

RUN_TIMEOUT_S = 120.0


def completion(custom_id: str, prompt: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": prompt, "max_tokens": 3, "temperature": 0, **body},
    }


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    (found,) = [c for c in status.get("conditions", []) if c["type"] == kind]
    return found


def test_batchjob_applied_with_kubectl_succeeds_with_counts_and_results(
    batchjobs: BatchJobs, operator: Any, cpu_worker: Service, volume: Path
) -> None:
    name = f"run-{uuid.uuid4().hex[:8]}"
    requests = [
        completion("a", "The capital of France is"),
        completion("b", "This one asks for no tokens", max_tokens=0),
        completion("c", "One, two, three,"),
    ]
    batchjobs.apply(
        name,
        {"model": MODEL, "input": {"inline": requests}, "output": {"path": f"{name}/out.jsonl"}},
    )
    status = batchjobs.wait_phase(name, "Succeeded", "Failed", timeout=RUN_TIMEOUT_S)
    assert status["phase"] == "Succeeded", status
    assert status["requestCounts"] == {"total": 3, "completed": 2, "failed": 1}
    assert status["progress"] == "100%"
    assert status["startTime"] and status["completionTime"]
    assert condition(status, "Submitted")["status"] == "True"
    assert condition(status, "Complete")["status"] == "True"
    outputs = lines(volume / name / "out.jsonl")
    assert [o["custom_id"] for o in outputs] == ["a", "c"]
    assert all(o["response"]["status_code"] == 200 for o in outputs)
    errors = lines(volume / name / "out.jsonl.errors.jsonl")
    assert [e["custom_id"] for e in errors] == ["b"]
    assert "max_tokens" in json.dumps(errors[0]["error"])
    assert {"Submitted", "Succeeded"} <= set(batchjobs.events(name))


def test_configmap_input_gets_the_default_sampling_params(
    batchjobs: BatchJobs, operator: Any, cpu_worker: Service, crd: KubeApi, volume: Path
) -> None:
    name = f"cm-{uuid.uuid4().hex[:8]}"
    chat = {
        "custom_id": "chat-1",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "Say something."}]},
    }
    text = "\n".join(
        json.dumps(r) for r in (chat, completion("own", "Keeps its own", max_tokens=1))
    )
    crd.kubectl(
        "create", "configmap", name, "-n", NAMESPACE, f"--from-literal=requests.jsonl={text}"
    )
    spec = {
        "model": MODEL,
        "input": {"configMap": {"name": name, "key": "requests.jsonl"}},
        "output": {"path": f"{name}.jsonl", "errorsPath": f"{name}-errors.jsonl"},
        "sampling": {"maxTokens": 5, "ignoreEos": True, "temperature": 0},
    }
    batchjobs.apply(name, spec)
    status = batchjobs.wait_phase(name, "Succeeded", "Failed", timeout=RUN_TIMEOUT_S)
    assert status["requestCounts"] == {"total": 2, "completed": 2, "failed": 0}, status
    usage = {
        o["custom_id"]: o["response"]["body"]["usage"] for o in lines(volume / f"{name}.jsonl")
    }
    assert usage["chat-1"]["completion_tokens"] == 5  # the BatchJob's default
    assert usage["own"]["completion_tokens"] == 1  # the request's own value wins
    assert (volume / f"{name}-errors.jsonl").read_text() == ""


def test_operator_restart_never_submits_twice(
    batchjobs: BatchJobs, operator_env: None, worker_deployment: str, planner: PlannerClient
) -> None:
    """Forgetting that submission finished (as a crash right after CreateJob would) must find the
    planner job created under the BatchJob's uid instead of creating another."""
    from kopf.testing import KopfRunner

    name = f"restart-{uuid.uuid4().hex[:8]}"
    requests = [completion("only", "Hello")]
    with KopfRunner(OPERATOR_ARGS, timeout=60):
        batchjobs.apply(
            name,
            {"model": MODEL, "input": {"inline": requests}, "output": {"path": f"{name}.jsonl"}},
        )
        first = wait_for("a planner job id", lambda: batchjobs.status(name).get("jobId"))
    kube = batchjobs.kube
    kube.kubectl(
        "annotate", "bj", name, "-n", NAMESPACE, "prefixgrove.io/last-handled-configuration-"
    )
    # the status subresource through the API (kubectl patch --subresource needs kubectl >= 1.24)
    api = client.CustomObjectsApi(config.new_client_from_config(str(kube.kubeconfig)))
    api.patch_namespaced_custom_object_status(
        "prefixgrove.io", "v1alpha1", NAMESPACE, "batchjobs", name,
        {"status": {"jobId": None, "phase": None}},
    )  # fmt: skip
    assert "jobId" not in batchjobs.status(name)
    with KopfRunner(OPERATOR_ARGS, timeout=60):
        again = wait_for("the job id again", lambda: batchjobs.status(name).get("jobId"))
    uid = batchjobs.get(name)["metadata"]["uid"]  # type: ignore[index]
    assert again == first
    assert planner.find_job(uid) is not None
    assert planner.find_job(uid).id == first  # type: ignore[union-attr]


def test_results_that_cannot_be_written_are_retried_until_they_can(
    batchjobs: BatchJobs, operator: Any, cpu_worker: Service, volume: Path
) -> None:
    name = f"blocked-{uuid.uuid4().hex[:8]}"
    (volume / name).write_text("a file where the output folder should be")
    spec = {
        "model": MODEL,
        "input": {"inline": [completion("x", "Hello there")]},
        "output": {"path": f"{name}/out.jsonl"},
    }
    batchjobs.apply(name, spec)
    status = batchjobs.wait_phase(name, "Finalizing", "Succeeded", "Failed", timeout=RUN_TIMEOUT_S)
    assert status["phase"] == "Finalizing", status
    assert "OutputNotWritten" in batchjobs.events(name)
    (volume / name).unlink()
    batchjobs.wait_phase(name, "Succeeded", timeout=30)
    assert [o["custom_id"] for o in lines(volume / name / "out.jsonl")] == ["x"]
