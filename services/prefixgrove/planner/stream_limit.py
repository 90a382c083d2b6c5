"""A cap on the calls that last as long as a job.

The planner's gRPC server runs every call on one thread of a fixed pool. `WatchJob` and a following
`StreamResults` hold their thread until the job ends, so enough of them would leave nothing for the
short calls, the health check (the readiness probe) and the operator's queue-depth reads: a deadlock
with the workers scaled to zero. This interceptor admits at most `limit` of them at once and answers
the next with RESOURCE_EXHAUSTED, so the pool always keeps threads for everything else.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

LONG_LIVED = frozenset({"WatchJob", "StreamResults"})


class StreamLimit(grpc.ServerInterceptor):
    def __init__(self, limit: int, methods: frozenset[str] = LONG_LIVED) -> None:
        self.limit = limit
        self.methods = methods
        self._slots = threading.BoundedSemaphore(limit)

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        handler = continuation(handler_call_details)
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler is None or method not in self.methods or handler.unary_stream is None:
            return handler
        return grpc.unary_stream_rpc_method_handler(
            self._limited(handler.unary_stream),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _limited(self, call: Callable[[Any, Any], Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        def limited(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if not self._slots.acquire(blocking=False):
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the planner already serves {self.limit} job watches and result streams, "
                    "its limit (--max-streams): retry later",
                )
            try:
                yield from call(request, context)
            finally:
                self._slots.release()

        return limited
