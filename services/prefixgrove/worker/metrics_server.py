"""The worker's metrics port: /metrics (and any other path) as Prometheus scrapes it, and /ready,
which answers 200 while the worker can do its work and 503 with the reason while it cannot (Redis
refusing its writes for lack of memory: redis_full.py)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes and probes every few seconds: not worth a log line each."""


def serve(port: int, host: str, registry: CollectorRegistry, not_ready: Callable[[], str]) -> None:
    """Serves on `host`:`port` from a daemon thread; `not_ready()` is the reason the worker is not
    ready, "" when it is."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/ready":
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        reason = not_ready()
        status = "503 Service Unavailable" if reason else "200 OK"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [f"{reason or 'ready'}\n".encode()]

    class Server(ThreadingWSGIServer):
        address_family = _family(host, port)

    httpd = make_server(host, port, app, Server, handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()


def _family(host: str, port: int) -> socket.AddressFamily:
    """IPv6 for an IPv6 host (`::`), else IPv4."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return infos[0][0]
