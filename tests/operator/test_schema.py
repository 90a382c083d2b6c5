"""The CRD's schema turns nonsense away at the API server, before the operator ever sees it."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import yaml
from k8s_fixtures import KubeApi


def batchjob(name: str, **spec: Any) -> str:
    body = {
        "apiVersion": "prefixgrove.io/v1alpha1",
        "kind": "BatchJob",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "model": "tiny-random-llama",
            "input": {"configMap": {"name": "questions", "key": "in.jsonl"}},
            "output": {"path": "out/result.jsonl"},
            **spec,
        },
    }
    return json.dumps(body)


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        ({"input": {"path": "../etc/passwd"}}, "spec.input.path"),
        ({"input": {"path": "/etc/passwd"}}, "spec.input.path"),
        ({"output": {"path": "a/../../b"}}, "spec.output.path"),
        ({"input": {}}, "spec.input.* must validate one and only one schema"),
        (
            {"input": {"path": "a", "configMap": {"name": "q", "key": "k"}}},
            "spec.input.* must validate one and only one schema",
        ),
        ({"maxFailedRatio": 2}, "spec.maxFailedRatio"),
        ({"queueTimeoutSeconds": 0}, "spec.queueTimeoutSeconds"),
        ({"cancel": "yes"}, "spec.cancel"),
        ({"sampling": {"temperature": -1}}, "spec.sampling.temperature"),
        ({"model": ""}, "spec.model"),
    ],
)
def test_schema_rejects_nonsense(crd: KubeApi, spec: dict[str, Any], complaint: str) -> None:
    name = f"bad-{uuid.uuid4().hex[:8]}"
    with pytest.raises(RuntimeError, match=complaint):
        crd.kubectl("apply", "-f", "-", input=batchjob(name, **spec))
    assert crd.kubectl("get", "bj", "--ignore-not-found", "-o", "name", name) == ""


def test_schema_accepts_a_sound_batchjob(crd: KubeApi) -> None:
    name = f"good-{uuid.uuid4().hex[:8]}"
    crd.kubectl(
        "apply",
        "--dry-run=server",
        "-f",
        "-",
        input=batchjob(name, sampling={"topP": 0.5}, maxFailedRatio=0.1, cancel=False),
    )


def test_unknown_fields_are_pruned_by_the_api_server_not_refused(crd: KubeApi) -> None:
    """Only a validating client (kubectl without --validate=false) refuses them; docs/operator.md
    says so."""
    name = f"pruned-{uuid.uuid4().hex[:8]}"
    body = batchjob(name, maxFailedRate=0.5)
    args = ("apply", "--validate=false", "--dry-run=server", "-o", "json", "-f", "-")
    stored = json.loads(crd.kubectl(*args, input=body))
    assert "maxFailedRate" not in stored["spec"]
    assert stored["spec"]["model"] == "tiny-random-llama"


def _undescribed(schema: dict[str, Any], where: str) -> list[str]:
    missing = [] if schema.get("description") else [where]
    for name, field in (schema.get("properties") or {}).items():
        missing += _undescribed(field, f"{where}.{name}")
    if "items" in schema:
        missing += _undescribed(schema["items"], f"{where}[]")
    return missing


def test_every_spec_field_says_what_it_is_for() -> None:
    """`kubectl explain bj.spec...` reads these descriptions."""
    from operator_testbed import CRD

    (version,) = yaml.safe_load(CRD.read_text())["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert _undescribed(spec, "spec") == []
