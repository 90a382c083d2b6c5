"""A BatchJob's `spec.credentialsSecret`: the Secret, in the BatchJob's namespace, whose keys are
the store's credentials and settings, named as the standard variables (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL; GOOGLE_SERVICE_ACCOUNT_KEY).

The operator reads it when it is needed (the Secret may be rotated), hands the values to the
planner that reads the input and to the writer of the results, and keeps nothing: no value goes
into status, an Event or a log line. Messages name the Secret and its keys, never a value."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from prefixgrove.storage.stores import JOB_CREDENTIAL_KEYS
from prefixgrove_operator.spec import InvalidSpec


def secret_credentials(core: client.CoreV1Api, namespace: str, name: str) -> dict[str, str]:
    """The Secret's keys and values; {} for no Secret (the operator's and planner's own
    credentials then: their environment, IRSA, workload identity)."""
    if not name:
        return {}
    try:
        secret = core.read_namespaced_secret(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            raise InvalidSpec(
                "CredentialsNotFound",
                f"spec.credentialsSecret: no Secret {name!r} in {namespace!r}",
            ) from None
        if exc.status == 403:
            raise InvalidSpec(
                "CredentialsNotReadable",
                f"spec.credentialsSecret: the operator may not read Secret {name!r} in "
                f"{namespace!r} (its Role lacks get on secrets there)",
            ) from None
        raise
    return _decoded(name, secret.data or {})


def _decoded(name: str, data: Mapping[str, Any]) -> dict[str, str]:
    unknown = sorted(set(data) - JOB_CREDENTIAL_KEYS)
    if unknown:
        raise InvalidSpec(
            "InvalidCredentials",
            f"spec.credentialsSecret: Secret {name!r} holds keys no store reads: {unknown}; "
            f"known: {sorted(JOB_CREDENTIAL_KEYS)}",
        )
    return {key: base64.b64decode(value).decode() for key, value in data.items()}
