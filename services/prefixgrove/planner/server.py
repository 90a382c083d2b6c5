"""Starts the planner: the gRPC service with health checking, reflection, auth and TLS, and the
OpenAI Batch API over HTTP beside it when an HTTP port is set."""

from __future__ import annotations

import ipaddress
import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prefixgrove.jobs.line_parser import LineParser, LineRules, default_processes
from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.planner.http.runner import HttpApi, start_http_api
from prefixgrove.planner.metrics import PlannerMetrics
from prefixgrove.planner.redis_wait import wait_for_redis
from prefixgrove.planner.security import BearerTokenInterceptor, server_credentials
from prefixgrove.planner.service import PlannerService
from prefixgrove.planner.stream_limit import StreamLimit
from prefixgrove.settings import IngestSettings, PlannerSettings, SecuritySettings
from prefixgrove_proto import planner_pb2, planner_pb2_grpc

log = logging.getLogger(__name__)
_HEARTBEAT_TTL_S = 30
_HOUSEKEEPING_S = _HEARTBEAT_TTL_S / 3
# a replica killed mid-upload: its heartbeat runs out, then the next round of another replica fails
# the upload (ingest_interrupted)
UPLOAD_FAILED_WITHIN_S = _HEARTBEAT_TTL_S + _HOUSEKEEPING_S
_SHORT_CALL_THREADS = 8  # beyond the streams (StreamLimit): calls that end, and the health check
SERVICE_NAME = planner_pb2.DESCRIPTOR.services_by_name["Planner"].full_name


class PlannerServer:
    """A started planner: the gRPC server, the port it listens on, the service behind it, and the
    threads that keep its heartbeat and metrics fresh; `stop` ends them all."""

    def __init__(self, grpc_server: grpc.Server, port: int, service: PlannerService) -> None:
        self.grpc_server = grpc_server
        self.port = port
        self.service = service
        self.stopping = threading.Event()  # the threads' loops end when it is set
        self.threads: list[threading.Thread] = []
        self.http: HttpApi | None = None

    def stop(self, grace: float | None = None) -> None:
        """Stops taking calls, lets those in flight run for `grace` seconds, joins the threads."""
        self.stopping.set()
        if self.http is not None:
            self.http.stop()
        self.grpc_server.stop(grace).wait()
        for thread in self.threads:
            thread.join()
        self.service.parser.close()
        self.service.object_inputs.close()


def build_server(
    planner: PlannerSettings, ingest: IngestSettings, security: SecuritySettings
) -> PlannerServer:
    """A started server (port 0 picks a free one), once Redis answers."""
    wait_for_redis(planner.redis_url)
    metrics = PlannerMetrics()
    store = JobStore(connect(planner.redis_url), retention_s=planner.job_retention_s)
    processes = planner.parse_processes or default_processes()
    parser = LineParser(LineRules(ingest.max_line_bytes, ingest.default_max_tokens), processes)
    parser.warm_up()
    service = PlannerService(store, planner.models, ingest, metrics, parser)
    service.heartbeat(_HEARTBEAT_TTL_S)
    service.recover()
    streams = StreamLimit(
        planner.max_streams,
        planner.stream_stall_timeout_s,
        {"AddRequests": planner.upload_idle_timeout_s},
    )
    interceptors: list[grpc.ServerInterceptor] = [streams]
    if security.auth_token:  # first: a call without the token is refused before it takes a slot
        interceptors.insert(0, BearerTokenInterceptor(security.auth_token))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=planner.max_streams + _SHORT_CALL_THREADS),
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", planner.max_message_bytes),
            ("grpc.max_send_message_length", planner.max_message_bytes),
        ],
    )
    _add_services(server, service)
    address = f"{planner.host}:{planner.port}"
    creds = server_credentials(security)
    port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"cannot listen on {address}")
    server.start()
    running = PlannerServer(server, port, service)
    running.threads.append(
        _start_housekeeping(service, running.stopping, planner.upload_idle_timeout_s)
    )
    running.threads.append(streams.start(running.stopping))
    if planner.metrics_port:
        running.threads += metrics.serve(
            planner.metrics_port, store.model_queue, running.stopping, planner.host
        )
    if planner.http_port:
        running.http = start_http_api(service, planner, security)
    log.info("planner listening on %s:%d (%s)", planner.host, port, "TLS" if creds else "plaintext")
    if not security.auth_token and not _is_loopback(planner.host):
        log.warning(
            "planner serves %s without a bearer token: anyone who reaches this address can submit, "
            "read and cancel jobs (set --auth-token / PREFIXGROVE_AUTH_TOKEN, or --host 127.0.0.1)",
            planner.host,
        )
    return running


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _add_services(server: grpc.Server, service: PlannerService) -> None:
    """The planner, health checking and reflection."""
    planner_pb2_grpc.add_PlannerServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (SERVICE_NAME, reflection.SERVICE_NAME, health.SERVICE_NAME), server
    )


def _start_housekeeping(
    service: PlannerService, stop: threading.Event, upload_idle_s: float
) -> threading.Thread:
    """Every round, on every replica: beats, fails the uploads of replicas that stopped (within
    UPLOAD_FAILED_WITHIN_S of their death) and those their clients left, forgets the cached
    uploads others ended, and trims the queues."""

    def loop() -> None:
        while not stop.wait(_HOUSEKEEPING_S):
            try:
                service.heartbeat(_HEARTBEAT_TTL_S)
                service.fail_orphaned_uploads()
                service.expire_idle_uploads(upload_idle_s)
                service.forget_ended_uploads()
                service.store.trim_queues()
            except Exception as exc:  # Redis away: the next round tries again
                log.warning("planner housekeeping failed: %s", exc)

    thread = threading.Thread(target=loop, name="planner-housekeeping", daemon=True)
    thread.start()
    return thread


def serve(planner: PlannerSettings, ingest: IngestSettings, security: SecuritySettings) -> None:
    """Runs until SIGTERM or SIGINT, then lets calls in flight finish for a few seconds."""
    server = build_server(planner, ingest, security)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=10)
