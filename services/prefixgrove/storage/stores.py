"""One obstore client per bucket, and the one place where its errors become StorageError.

Credentials are found the way each platform's own tools find them: for S3, AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, web identity (IRSA: AWS_ROLE_ARN and
AWS_WEB_IDENTITY_TOKEN_FILE), ECS and EC2 instance roles; for GCS, GOOGLE_APPLICATION_CREDENTIALS,
the gcloud application-default file and the metadata server (workload identity). Nothing here holds
or logs a secret: an error's message is built from the URL, the operation and the store's error
code, never from the store's own text (which may quote a request's signature or key id).
"""

from __future__ import annotations

import functools
import os
import re
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


def store_for(location: ObjectLocation) -> Any:
    """The client of `location`'s bucket (made once per bucket and process)."""
    return _store(location.scheme, location.bucket, cfg.load(StorageSettings), _credentials_env())


def _credentials_env() -> tuple[tuple[str, str], ...]:
    """The variables a client reads its credentials and endpoint from: a client is made again
    when they change (tests, a rotated key)."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_CLIENT_VARIABLES)))


_CLIENT_VARIABLES = ("AWS_", "GOOGLE_")


@functools.lru_cache(maxsize=64)
def _store(
    scheme: str, bucket: str, settings: StorageSettings, _env: tuple[tuple[str, str], ...]
) -> Any:
    try:
        from obstore.store import GCSStore, S3Store
    except ImportError:
        extra = "s3" if scheme == "s3" else "gcs"
        raise StorageError(
            f"{scheme}://{bucket}: object storage needs obstore: pip install 'prefixgrove[{extra}]'"
        ) from None
    if scheme == "gs":
        options = {"base_url": settings.gcs_endpoint_url} if settings.gcs_endpoint_url else {}
        return GCSStore(bucket, **options)  # type: ignore[arg-type]
    s3: dict[str, Any] = {}
    if settings.s3_endpoint_url:
        s3["endpoint"] = settings.s3_endpoint_url
    if settings.s3_region:
        s3["region"] = settings.s3_region
    client = {"allow_http": True} if _plain_http(settings) else {}
    return S3Store(bucket, client_options=client, **s3)  # type: ignore[arg-type]


def _plain_http(settings: StorageSettings) -> bool:
    endpoint = settings.s3_endpoint_url or os.environ.get("AWS_ENDPOINT_URL", "")
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
