"""The gRPC health check, as tests poll it: whether a server (the planner) serves yet."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def serving(channel: grpc.Channel, timeout: float) -> bool:
    """Whether the server behind `channel` answers SERVING within `timeout` seconds; one that
    does not answer is not serving (yet)."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout
        )
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
