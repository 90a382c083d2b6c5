"""One obstore client per bucket, and the one place where its errors become StorageError.

Credentials are found the way each platform's own tools find them: for S3, AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, web identity (IRSA: AWS_ROLE_ARN and
AWS_WEB_IDENTITY_TOKEN_FILE), ECS and EC2 instance roles; for GCS, GOOGLE_APPLICATION_CREDENTIALS,
the gcloud application-default file and the metadata server (workload identity). Nothing here holds
or logs a secret: an error's message is built from the URL, the operation and the store's error
code, never from the store's own text (which may quote a request's signature or key id).

A job may bring credentials of its own (a BatchJob's `spec.credentialsSecret`): `job_credentials`
gives them, named as the standard variables, to the stores made in its block on this thread, over
the process's own; nothing else in the process sees them.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from prefixgrove import settings as cfg
from prefixgrove.settings import StorageSettings
from prefixgrove.storage.locations import ObjectLocation, StorageError

_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")
# the store's error code -> the cause, as people read it
_CAUSES = {
    "NoSuchBucket": "no such bucket",
    "NoSuchKey": "no such object",
    "AccessDenied": "access denied (the credentials may not do this: see the bucket's policy)",
    "AllAccessDisabled": "access denied (every access to the bucket is disabled)",
    "InvalidAccessKeyId": "wrong credentials (the access key id is unknown to the store)",
    "SignatureDoesNotMatch": "wrong credentials (the secret key does not match the key id)",
    "ExpiredToken": "the credentials expired",
    "InvalidToken": "wrong credentials (the session token is invalid)",
    "PermanentRedirect": "wrong region (the bucket lives in another one: set AWS_REGION)",
    "AuthorizationHeaderMalformed": "wrong region (the bucket lives in another one: set AWS_REGION)",
    "IllegalLocationConstraintException": "wrong region (set AWS_REGION to the bucket's)",
    "InvalidBucketName": "the bucket name is invalid",
}


# what a job's credentials may set: the variables each store's own tools read
JOB_CREDENTIAL_KEYS = frozenset({
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
    "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "GOOGLE_SERVICE_ACCOUNT_KEY",
})  # fmt: skip
_JOB_CREDENTIALS: ContextVar[tuple[tuple[str, str], ...]] = ContextVar(
    "job_credentials", default=()
)


@contextmanager
def job_credentials(env: Mapping[str, str]) -> Iterator[None]:
    """Within the block, stores made on this thread use `env` (keys of JOB_CREDENTIAL_KEYS; others
    are refused, naming them but never a value) over the process's own credentials."""
    unknown = sorted(set(env) - JOB_CREDENTIAL_KEYS)
    if unknown:
        raise StorageError(
            f"credentials hold keys no store reads: {unknown}; known: {sorted(JOB_CREDENTIAL_KEYS)}"
        )
    token = _JOB_CREDENTIALS.set(tuple(sorted(env.items())))
    try:
        yield
    finally:
        _JOB_CREDENTIALS.reset(token)


def store_for(location: ObjectLocation) -> Any:
    """The client of `location`'s bucket (made once per bucket, process and set of credentials)."""
    settings = cfg.load(StorageSettings)
    return _store(location.scheme, location.bucket, settings, _credentials_env(),
                  _JOB_CREDENTIALS.get())  # fmt: skip


def _credentials_env() -> tuple[tuple[str, str], ...]:
    """The variables a client reads its credentials and endpoint from: a client is made again
    when they change (tests, a rotated key)."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_CLIENT_VARIABLES)))


_CLIENT_VARIABLES = ("AWS_", "GOOGLE_")


@functools.lru_cache(maxsize=64)
def _store(
    scheme: str,
    bucket: str,
    settings: StorageSettings,
    _env: tuple[tuple[str, str], ...],
    job: tuple[tuple[str, str], ...],
) -> Any:
    try:
        from obstore.store import GCSStore, S3Store
    except ImportError:
        extra = "s3" if scheme == "s3" else "gcs"
        raise StorageError(
            f"{scheme}://{bucket}: object storage needs obstore: pip install 'prefixgrove[{extra}]'"
        ) from None
    own = dict(job)
    if scheme == "gs":
        gcs = {k: v for k, v in own.items() if k.startswith("GOOGLE_")}
        options = {"base_url": settings.gcs_endpoint_url} if settings.gcs_endpoint_url else {}
        return GCSStore(bucket, config=gcs or None, **options)  # type: ignore[arg-type]
    # the job's own endpoint and region name the store of its bucket: they win over the settings
    config: dict[str, Any] = {k: v for k, v in own.items() if k.startswith("AWS_")}
    if settings.s3_endpoint_url and "AWS_ENDPOINT_URL" not in config:
        config["AWS_ENDPOINT_URL"] = settings.s3_endpoint_url
    if settings.s3_region and not {"AWS_REGION", "AWS_DEFAULT_REGION"} & set(config):
        config["AWS_REGION"] = settings.s3_region
    client = {"allow_http": True} if _plain_http(settings, own) else {}
    return S3Store(bucket, config=config or None, client_options=client)  # type: ignore[arg-type]


def _plain_http(settings: StorageSettings, job: Mapping[str, str]) -> bool:
    endpoint = (
        job.get("AWS_ENDPOINT_URL")
        or settings.s3_endpoint_url
        or os.environ.get("AWS_ENDPOINT_URL", "")
    )
    return endpoint.startswith("http://")


def storage_error(exc: BaseException, url: str, doing: str) -> StorageError:
    """`exc` (an obstore error) as a StorageError naming the URL, what was being done and why."""
    if isinstance(exc, StorageError):
        return exc
    return StorageError(f"{url}: {doing} failed: {cause(exc)}")


def cause(exc: BaseException) -> str:
    """Why an operation failed, in words that never quote the store's message."""
    from obstore import exceptions as obx

    text = str(exc)
    code = _CODE.search(text)
    if code and code.group(1) in _CAUSES:
        return _CAUSES[code.group(1)]
    if isinstance(exc, FileNotFoundError | obx.NotFoundError):
        return "no such object (or no such bucket)"
    if isinstance(exc, obx.UnauthenticatedError):
        return "the credentials were refused"
    if isinstance(exc, PermissionError | obx.PermissionDeniedError):
        return "access denied"
    if "error sending request" in text or "Connection refused" in text or "tcp connect" in text:
        return "the store could not be reached (check the endpoint URL and the network)"
    if code:
        return f"the store answered {code.group(1)}"
    return f"{type(exc).__name__} from the store"
