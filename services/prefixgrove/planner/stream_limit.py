"""A cap on the planner's streaming calls, which keeps threads for everything else.

The planner's gRPC server runs every call on one thread of a fixed pool. A streaming call holds its
thread as long as it lasts: an upload (`AddRequests`) until its client's last chunk, `WatchJob` and
a following `StreamResults` until the job ends, the health watch and reflection until their client
leaves. Enough of them would leave nothing for the short calls, the health check (the readiness
probe) and the operator's queue-depth reads: a deadlock with the workers scaled to zero. This
interceptor admits at most `limit` streaming calls of any kind at once and answers the next with
RESOURCE_EXHAUSTED, so the pool always keeps threads for the short calls; and it hands each stream
to the watchdog (stream_watchdog.py), which ends a stream stalled on its client at its timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc

from prefixgrove.planner.stream_watchdog import (
    StreamStalled,
    StreamWatchdog,
    WatchedStream,
    watched_requests,
    watched_responses,
)

_Behavior = Callable[[Any, grpc.ServicerContext], Any]


class StreamLimit(grpc.ServerInterceptor):
    """`stall_s`: how long a stream may wait on its client, unless `stall_s_by_method` (by the
    method's short name) says otherwise."""

    def __init__(
        self, limit: int, stall_s: float, stall_s_by_method: Mapping[str, float] | None = None
    ) -> None:
        self.limit = limit
        self.stall_s = stall_s
        self.stall_s_by_method = dict(stall_s_by_method or {})
        self.watchdog = StreamWatchdog()
        self._slots = threading.BoundedSemaphore(limit)

    def start(self, stop: threading.Event) -> threading.Thread:
        """Starts the watchdog's thread, which ends when `stop` is set."""
        shortest = min([self.stall_s, *self.stall_s_by_method.values()])
        return self.watchdog.start(stop, shortest / 4)

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        if getattr(handler.unary_stream, "experimental_non_blocking", False):
            return handler  # the health watch: it answers through callbacks and holds no thread
        method = handler_call_details.method.rsplit("/", 1)[-1]
        timeout = self.stall_s_by_method.get(method, self.stall_s)
        codec = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_stream is not None:
            wrapped = self._responses(method, timeout, handler.unary_stream, watch_requests=False)
            return grpc.unary_stream_rpc_method_handler(wrapped, **codec)
        if handler.stream_stream is not None:
            wrapped = self._responses(method, timeout, handler.stream_stream, watch_requests=True)
            return grpc.stream_stream_rpc_method_handler(wrapped, **codec)
        return grpc.stream_unary_rpc_method_handler(
            self._upload(method, timeout, handler.stream_unary), **codec
        )

    def _admit(self, method: str, context: grpc.ServicerContext, timeout: float) -> WatchedStream:
        if not self._slots.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{method} refused: the planner already serves {self.limit} streaming calls "
                f"(uploads, job watches, result streams), its limit (--max-streams "
                f"{self.limit}): retry later",
            )
        stream = WatchedStream(method, context, timeout)
        self.watchdog.add(stream)
        return stream

    def _leave(self, stream: WatchedStream) -> None:
        self.watchdog.remove(stream)
        self._slots.release()

    def _upload(self, method: str, timeout: float, call: _Behavior) -> _Behavior:
        def limited(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            stream = self._admit(method, context, timeout)
            try:
                return call(watched_requests(requests, stream), context)
            except StreamStalled as exc:
                context.abort(grpc.StatusCode.CANCELLED, str(exc))
            finally:
                self._leave(stream)

        return limited

    def _responses(
        self, method: str, timeout: float, call: _Behavior, watch_requests: bool
    ) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
        def limited(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            stream = self._admit(method, context, timeout)
            try:
                if watch_requests:
                    request = watched_requests(request, stream)
                yield from watched_responses(call(request, context), stream)
            except StreamStalled as exc:
                context.abort(grpc.StatusCode.CANCELLED, str(exc))
            finally:
                self._leave(stream)

        return limited
