"""Ends the streaming calls stalled on their client, so their threads come back.

A streaming call holds its thread of the gRPC server's pool while its handler waits on the client:
for the next request message (an upload whose client stopped sending) or for a message to go out
(a reader that stopped reading, once gRPC flow control is full). Nothing in gRPC ends such a wait
while the connection lives. The watchdog times each wait, and cancels the call whose wait outlasts
the stream's timeout: the handler wakes, its stream ends, and its thread returns to the pool.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

log = logging.getLogger(__name__)
_MAX_TICK_S = 1.0
_MIN_TICK_S = 0.05


class StreamStalled(Exception):
    """Raised in the handler of a stream the watchdog cancelled."""


class WatchedStream:
    """One streaming call: how long it may wait on its client, and since when it waits."""

    def __init__(self, method: str, context: grpc.ServicerContext, timeout_s: float) -> None:
        self.method = method
        self.context = context
        self.timeout_s = timeout_s
        self.waiting_since: float | None = None  # monotonic seconds; None while not waiting
        self.cancelled = False

    def stalled(self) -> StreamStalled:
        return StreamStalled(
            f"{self.method}: the client took or sent no message for {self.timeout_s:g}s; "
            "the planner ended the stream"
        )


class StreamWatchdog:
    """Times the waits of the streams it watches; `run` cancels those stalled, until stopped."""

    def __init__(self) -> None:
        self._streams: set[WatchedStream] = set()
        self._lock = threading.Lock()

    def add(self, stream: WatchedStream) -> None:
        with self._lock:
            self._streams.add(stream)

    def remove(self, stream: WatchedStream) -> None:
        with self._lock:
            self._streams.discard(stream)

    def start(self, stop: threading.Event, tick_s: float) -> threading.Thread:
        """Checks the streams every `tick_s` (within bounds) until `stop` is set."""
        tick = min(max(tick_s, _MIN_TICK_S), _MAX_TICK_S)

        def loop() -> None:
            while not stop.wait(tick):
                self.cancel_stalled(time.monotonic())

        thread = threading.Thread(target=loop, name="planner-stream-watchdog", daemon=True)
        thread.start()
        return thread

    def cancel_stalled(self, now: float) -> list[WatchedStream]:
        """Cancels every stream that has waited on its client past its timeout; returns them."""
        with self._lock:
            stalled = [
                s
                for s in self._streams
                if not s.cancelled
                and s.waiting_since is not None
                and now - s.waiting_since > s.timeout_s
            ]
            for stream in stalled:
                stream.cancelled = True
        for stream in stalled:
            log.warning("%s", stream.stalled())
            stream.context.cancel()  # wakes the handler's wait; its thread ends the call
        return stalled


def watched_requests(requests: Iterator[Any], stream: WatchedStream) -> Iterator[Any]:
    """The client's messages, each wait for the next one timed; a stream the watchdog cancelled
    raises StreamStalled rather than ending as if the client had finished."""
    while True:
        stream.waiting_since = time.monotonic()
        try:
            message = next(requests)
        except StopIteration:
            break
        except grpc.RpcError:
            if stream.cancelled:
                raise stream.stalled() from None
            raise
        finally:
            stream.waiting_since = None
        yield message
    if stream.cancelled:
        raise stream.stalled()


def watched_responses(responses: Iterator[Any], stream: WatchedStream) -> Iterator[Any]:
    """The handler's messages, each handed to gRPC and timed until gRPC asks for the next one
    (which it does once the message is sent)."""
    try:
        for message in responses:
            stream.waiting_since = time.monotonic()
            yield message
            stream.waiting_since = None
    finally:
        close = getattr(responses, "close", None)
        if close is not None:
            close()  # the handler's own cleanup runs now, not whenever it is collected
