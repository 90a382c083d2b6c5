"""Starts the planner: the gRPC service with health checking, reflection, auth and TLS."""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prefixgrove_proto import planner_pb2, planner_pb2_grpc

from prefixgrove.jobs.connection import connect
from prefixgrove.jobs.store import JobStore
from prefixgrove.planner.metrics import PlannerMetrics
from prefixgrove.planner.security import BearerTokenInterceptor, server_credentials
from prefixgrove.planner.service import PlannerService
from prefixgrove.settings import IngestSettings, PlannerSettings, SecuritySettings

log = logging.getLogger(__name__)
_HEARTBEAT_TTL_S = 30
SERVICE_NAME = planner_pb2.DESCRIPTOR.services_by_name["Planner"].full_name


def build_server(
    planner: PlannerSettings, ingest: IngestSettings, security: SecuritySettings
) -> tuple[grpc.Server, int, PlannerService]:
    """A started server and the port it listens on (port 0 picks a free one)."""
    metrics = PlannerMetrics()
    store = JobStore(connect(planner.redis_url), retention_s=planner.job_retention_s)
    service = PlannerService(store, planner.model, ingest, metrics)
    service.heartbeat(_HEARTBEAT_TTL_S)
    service.recover()
    _start_housekeeping(service)
    interceptors = [BearerTokenInterceptor(security.auth_token)] if security.auth_token else []
    options = [
        ("grpc.max_receive_message_length", planner.max_message_bytes),
        ("grpc.max_send_message_length", planner.max_message_bytes),
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16), interceptors=interceptors, options=options
    )
    planner_pb2_grpc.add_PlannerServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, reflection.SERVICE_NAME, health.SERVICE_NAME), server
    )
    address = f"{planner.host}:{planner.port}"
    creds = server_credentials(security)
    port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"cannot listen on {address}")
    server.start()
    if planner.metrics_port:
        metrics.serve(planner.metrics_port, store.model_queue)
    log.info("planner listening on %s:%d (%s)", planner.host, port, "TLS" if creds else "plaintext")
    return server, port, service


def _start_housekeeping(service: PlannerService) -> None:
    def loop() -> None:
        while True:
            time.sleep(_HEARTBEAT_TTL_S / 3)
            try:
                service.heartbeat(_HEARTBEAT_TTL_S)
                service.recover()
            except Exception as exc:  # Redis away: the next round tries again
                log.warning("planner housekeeping failed: %s", exc)

    threading.Thread(target=loop, name="planner-housekeeping", daemon=True).start()


def serve(planner: PlannerSettings, ingest: IngestSettings, security: SecuritySettings) -> None:
    """Runs until SIGTERM or SIGINT, then lets calls in flight finish for a few seconds."""
    server, _, _ = build_server(planner, ingest, security)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=10).wait()
