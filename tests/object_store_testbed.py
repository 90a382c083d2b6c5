"""A real S3-compatible server for the object-storage tests: moto's server mode, one process for a
test module on a free loopback port, with IAM checks on, so that wrong credentials are refused as
a real store refuses them. A test that needs it fails without moto under CI=true (scripts/setup.sh
installs it with the test extra), skips otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from polling import wait_for
from services_testbed import free_port

REGION = "us-east-1"
# requests moto answers before it checks credentials: the IAM user and key the tests sign with
_SETUP_REQUESTS = 3
_ALL = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


def need_moto() -> None:
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
        import obstore  # noqa: F401
    except ImportError as exc:
        message = f"moto's server mode, boto3 or obstore is not installed ({exc}): scripts/setup.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    proc: subprocess.Popen[bytes]

    def env(self) -> dict[str, str]:
        """What a client of this store is given: the standard AWS variables and the endpoint."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": REGION,
            "PREFIXGROVE_S3_ENDPOINT_URL": self.endpoint,
        }

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key)  # fmt: skip

    def bucket(self) -> str:
        """A new, empty bucket."""
        name = f"pg-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def get(self, bucket: str, key: str) -> bytes:
        return bytes(self.client().get_object(Bucket=bucket, Key=key)["Body"].read())

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def keys(self, bucket: str) -> list[str]:
        listed = self.client().list_objects_v2(Bucket=bucket).get("Contents", [])
        return sorted(o["Key"] for o in listed)


def start_s3_server(workdir: Path) -> S3Server:
    need_moto()
    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(_SETUP_REQUESTS)}
    log = (workdir / "moto.log").open("ab")
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    endpoint = f"http://127.0.0.1:{port}"
    wait_for("moto's server to answer", lambda: _answers(endpoint), 30)
    key = _iam_user(endpoint)
    return S3Server(endpoint, key["AccessKeyId"], key["SecretAccessKey"], proc)


def _answers(endpoint: str) -> bool:
    import urllib.request

    try:
        urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
        return True
    except OSError:
        return False


def _iam_user(endpoint: str) -> dict[str, str]:
    import boto3

    iam = boto3.client("iam", endpoint_url=endpoint, region_name=REGION,
                       aws_access_key_id="setup", aws_secret_access_key="setup")  # fmt: skip
    iam.create_user(UserName="prefixgrove")
    key = iam.create_access_key(UserName="prefixgrove")["AccessKey"]
    iam.put_user_policy(UserName="prefixgrove", PolicyName="all", PolicyDocument=json.dumps(_ALL))
    return dict(key)


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_s3_server(tmp_path_factory.mktemp("moto"))
    try:
        yield server
    finally:
        server.proc.terminate()
        server.proc.wait(10)


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The module's server, its credentials and endpoint in this test's environment."""
    for name in [n for n in os.environ if n.startswith(("AWS_", "PREFIXGROVE_S3_"))]:
        monkeypatch.delenv(name)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server
