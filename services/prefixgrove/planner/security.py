"""gRPC transport security: TLS / mutual TLS credentials and the bearer-token check."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from prefixgrove.settings import SecuritySettings

# Probes (Kubernetes' gRPC health checks) carry no token.
_OPEN_METHODS = ("/grpc.health.v1.Health/",)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call without `authorization: Bearer <token>` with UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = deny

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        if details.method.startswith(_OPEN_METHODS):
            return continuation(details)
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        sent_bytes = sent.encode() if isinstance(sent, str) else sent
        if hmac.compare_digest(sent_bytes, self._expected):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(self._deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(self._deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(self._deny)
        return grpc.unary_unary_rpc_method_handler(self._deny)


def server_credentials(settings: SecuritySettings) -> grpc.ServerCredentials | None:
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    pair = (_read(settings.tls_key), _read(settings.tls_cert))
    ca = _read(settings.tls_ca) if settings.tls_ca else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=ca, require_client_auth=ca is not None
    )


def channel(target: str, settings: SecuritySettings, *, tls: bool = False) -> grpc.Channel:
    """A client channel: TLS when a CA or client certificate is given (or tls=True), and the
    bearer token attached to every call when one is set."""
    options = [
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
    ]
    secure = tls or settings.tls_ca is not None or settings.tls_client_cert is not None
    if not secure:
        ch = grpc.insecure_channel(target, options=options)
        if settings.auth_token:
            ch = grpc.intercept_channel(ch, _TokenClientInterceptor(settings.auth_token))
        return ch
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(settings.tls_ca) if settings.tls_ca else None,
        private_key=_read(settings.tls_client_key) if settings.tls_client_key else None,
        certificate_chain=_read(settings.tls_client_cert) if settings.tls_client_cert else None,
    )
    if settings.auth_token:
        token = grpc.access_token_call_credentials(settings.auth_token)
        creds = grpc.composite_channel_credentials(creds, token)
    return grpc.secure_channel(target, creds, options=options)


class _TokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token on a plaintext channel (gRPC sends call credentials only over TLS)."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self._header]
        return (
            details._replace(metadata=metadata)
            if hasattr(details, "_replace")
            else _Details(details, metadata)
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        return continuation(self._with_token(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base: Any, metadata: list[tuple[str, str]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()
