"""Certificates for the planner's mutual-TLS tests, made with openssl in the test's folder."""

from __future__ import annotations

import subprocess
from pathlib import Path

from prefixgrove.settings import SecuritySettings


def mutual_tls(d: Path) -> SecuritySettings:
    """Writes a CA and a server and a client certificate it signed into `d`; returns a planner's
    settings that serve with the server's and demand a client's."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
            "-days", "2", "-subj", "/CN=test-ca")  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}")  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    return SecuritySettings(
        tls_cert=f"{d}/server.pem", tls_key=f"{d}/server.key", tls_ca=f"{d}/ca.pem"
    )
