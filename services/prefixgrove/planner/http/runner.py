"""Runs the OpenAI Batch API in the planner's process: an aiohttp server on a thread and event
loop of its own, with the planner's TLS settings."""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from prefixgrove.planner.http.app import build_app
from prefixgrove.planner.http.batches import Batches
from prefixgrove.planner.http.files import Files, FileStore
from prefixgrove.planner.service import PlannerService
from prefixgrove.settings import PlannerSettings, SecuritySettings

log = logging.getLogger(__name__)
_FEEDERS = 4  # batches whose input streams into their job at once
_START_TIMEOUT_S = 30.0


class HttpApi:
    """A started HTTP API; `stop` closes its listener and ends its thread."""

    def __init__(self, runner: web.AppRunner, feeders: ThreadPoolExecutor) -> None:
        self.runner = runner
        self.feeders = feeders
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._thread = threading.Thread(target=self.loop.run_forever, name="http-api", daemon=True)

    def start(self, host: str, port: int, tls: ssl.SSLContext | None) -> None:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(self._listen(host, port, tls), self.loop)
        self.port = started.result(_START_TIMEOUT_S)

    async def _listen(self, host: str, port: int, tls: ssl.SSLContext | None) -> int:
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, ssl_context=tls)
        await site.start()
        return int(self.runner.addresses[0][1])

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(_START_TIMEOUT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.feeders.shutdown(wait=False, cancel_futures=True)


def start_http_api(
    service: PlannerService, planner: PlannerSettings, security: SecuritySettings
) -> HttpApi:
    files = _file_store(planner)
    feeders = ThreadPoolExecutor(_FEEDERS, thread_name_prefix="batch-feed")
    app = build_app(Batches(service, files, feeders), files, security.auth_token)
    api = HttpApi(web.AppRunner(app, access_log=None), feeders)
    tls = tls_context(security)
    api.start(planner.host, planner.http_port, tls)
    log.info("OpenAI Batch API on %s://%s:%d/v1 (files in %s)",
             "https" if tls else "http", planner.host, api.port, files.root)  # fmt: skip
    return api


def _file_store(planner: PlannerSettings) -> Files:
    """The uploaded files: in the bucket of --files-url (every replica shares them), else on the
    planner's disk under --data-dir."""
    if not planner.files_url:
        return FileStore(planner.files_dir)
    from prefixgrove import settings as cfg
    from prefixgrove.planner.http.object_files import ObjectFileStore
    from prefixgrove.settings import StorageSettings

    return ObjectFileStore(planner.files_url, cfg.load(StorageSettings).object_part_bytes)


def tls_context(security: SecuritySettings) -> ssl.SSLContext | None:
    """The gRPC server's TLS, for HTTPS: its certificate, and client certificates signed by its
    CA required when one is set (mutual TLS)."""
    if security.tls_cert is None or security.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(security.tls_cert, security.tls_key)
    if security.tls_ca:
        context.load_verify_locations(security.tls_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
