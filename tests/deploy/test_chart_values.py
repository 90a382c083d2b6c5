"""The chart's values: lint-clean in every supported shape, every value documented, nonsense refused
with a message that names the offending value."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from deploy_tools import CHART, helm

VALID_SHAPES = {
    "defaults": [],
    "external redis": ["--set", "redis.enabled=false", "--set", "redis.external.url=redis://r:6379/0"],
    "external redis from a secret": [
        "--set", "redis.enabled=false", "--set", "redis.external.existingSecret=redis-url",
    ],
    "cpu workers, no autoscaling": [
        "--set", "worker.device=cpu", "--set", "worker.gpus=0", "--set", "autoscaling.enabled=false",
    ],
    "cluster-wide operator with auth": [
        "--set", "operator.watchScope=cluster", "--set", "auth.enabled=true",
    ],
    "model from a claim, pdb, dashboard": [
        "--set", "worker.modelVolume.type=persistentVolumeClaim",
        "--set", "worker.modelVolume.claimName=llama-weights",
        "--set", "worker.kernelCache.type=persistentVolumeClaim",
        "--set", "worker.kernelCache.claimName=kernel-cache",
        "--set", "planner.podDisruptionBudget.enabled=true",
        "--set", "metrics.grafanaDashboard.enabled=true",
    ],
    "no operator": ["--set", "operator.enabled=false"],
    "mutual tls": [
        "--set", "tls.enabled=true", "--set", "tls.secretName=planner-tls",
        "--set", "tls.mutual=true", "--set", "tls.clientSecretName=operator-tls",
    ],
}  # fmt: skip


@pytest.mark.parametrize("shape", list(VALID_SHAPES))
def test_chart_passes_helm_lint_strict(shape: str) -> None:
    done = helm("lint", "--strict", str(CHART), *VALID_SHAPES[shape])
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout


NONSENSE = [
    ("worker.device=tpu", "worker.device"),
    ("worker.gpus=-1", "worker.gpus"),
    ("worker.gpus=0", "worker.device is cuda but worker.gpus is 0"),
    ("worker.modelVolume.type=nfs", "worker.modelVolume.type"),
    ("worker.modelVolume.type=hostPath", "worker.modelVolume.hostPath is required"),
    ("worker.kernelCache.type=nfs", "worker.kernelCache.type"),
    ("worker.kernelCache.type=hostPath", "worker.kernelCache.hostPath is required"),
    ("worker.kernelCache.claimName=Not_A_Claim", "worker.kernelCache.claimName"),
    ("autoscaling.groupsPerWorker=0", "autoscaling.groupsPerWorker"),
    ("autoscaling.maxReplicas=0", "autoscaling.maxReplicas"),
    (
        "autoscaling.minReplicas=9",
        "autoscaling.maxReplicas (8) must be >= autoscaling.minReplicas (9)",
    ),
    ("planner.port=70000", "planner.port"),
    ("planner.replicas=two", "planner.replicas"),
    ("redis.appendfsync=sometimes", "redis.appendfsync"),
    ("redis.auth.password=p@ss/word", "redis.auth.password"),
    ("redis.enabled=false", "redis.external.url (or redis.external.existingSecret) is required"),
    ("redis.external.url=http://redis:6379", "redis.external.url"),
    ("redis.persistence.size=lots", "redis.persistence.size"),
    ("operator.watchScope=everywhere", "operator.watchScope"),
    ("data.mountPath=data", "data.mountPath"),
    ("image.pullPolicy=Sometimes", "image.pullPolicy"),
    ("metrics.serviceMonitor.interval=often", "metrics.serviceMonitor.interval"),
    ("wrker.replicas=2", "Additional property wrker is not allowed"),
    ("worker.replica=2", "Additional property replica is not allowed"),
    ("metrics.serviceMonitor.enabled=true", "needs the monitoring.coreos.com/v1 API"),
    ("tls.enabled=true", "tls.enabled needs tls.secretName"),
    ("tls.mutual=true", "tls.mutual needs tls.enabled"),
    ("tls.secretName=Not_A_Name", "tls.secretName"),
]


@pytest.mark.parametrize(("setting", "complaint"), NONSENSE, ids=[s for s, _ in NONSENSE])
def test_nonsense_values_are_refused_naming_the_value(setting: str, complaint: str) -> None:
    done = helm("template", "t", str(CHART), "--set", setting, check=False)
    assert done.returncode != 0, f"{setting} was accepted"
    assert complaint in done.stderr, done.stderr


def _schema_node(schema: dict[str, Any], path: str) -> dict[str, Any] | None:
    node: dict[str, Any] | None = schema
    for key in path.split("."):
        node = (node or {}).get("properties", {}).get(key)
    return node


def _values() -> list[tuple[int, str]]:
    """(line number, dotted path) of every value: a key documented as a whole, or one whose schema is
    not a closed object of its own keys (free-form maps such as labels count as one value)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    found: list[tuple[int, str]] = []
    stack: list[tuple[int, str]] = []
    leaf_indent: int | None = None
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z][\w.]*):", line)
        if not m:
            continue
        indent = len(m.group(1))
        if leaf_indent is not None and indent > leaf_indent:
            continue  # inside a value (a map or list item)
        leaf_indent = None
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [m.group(2)])
        node = _schema_node(schema, path) or {}
        documented = i > 0 and lines[i - 1].lstrip().startswith("# --")
        closed = node.get("type") == "object" and node.get("additionalProperties") is False
        if closed and not documented:
            stack.append((indent, m.group(2)))
        else:
            found.append((i, path))
            leaf_indent = indent
    return found


def test_every_value_is_documented_in_values_yaml() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, path in _values():
        j = i - 1
        while j >= 0 and lines[j].lstrip().startswith("#") and "# --" not in lines[j]:
            j -= 1
        if j < 0 or "# --" not in lines[j]:
            undocumented.append(path)
    assert not undocumented, f"values without a '# --' description: {undocumented}"


def test_every_value_is_in_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    paths = [path for _, path in _values()]
    assert len(paths) > 80
    unknown = [path for path in paths if _schema_node(schema, path) is None]
    assert not unknown, f"values missing from values.schema.json: {unknown}"
