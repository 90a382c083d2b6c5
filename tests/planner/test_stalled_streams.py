"""No stream starves the planner: hundreds of uploads, job watches and result streams left
stalled by their clients, against a planner process and a redis-server on loopback.

Every streaming call counts toward --max-streams (the next is refused with RESOURCE_EXHAUSTED),
the health check and the short calls answer while the streams stall, and a stalled stream gives
its slot and its thread back at its timeout. Short calls get a generous deadline: that they
answer at all is the behaviour, not how fast."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from services_testbed import ServiceStack, batch_line, service_stack, wait_until

from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.schema import ResultRecord
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove_proto import planner_pb2 as pb
from prefixgrove_proto import planner_pb2_grpc as pb_grpc

CAP = 16  # the planners' --max-streams here
HUNDREDS = 300  # streams of a kind opened at once
ANSWER_S = 60.0  # the deadline of a short call
PATIENT = 3600.0  # a timeout no test reaches
SHORT = 2.0  # a timeout every test reaches
_STREAMS_PER_CHANNEL = 25  # as many clients would: several connections
_RESULT_LINE = "x" * (1 << 20)
_RESULT_LINES = 64  # more than flow control and the sockets hold for a reader that reads nothing


@contextmanager
def planner(d: Path, *, upload_idle_s: float, stall_s: float) -> Iterator[ServiceStack]:
    args = ("--max-streams", str(CAP), "--upload-idle-timeout-s", str(upload_idle_s),
            "--stream-stall-timeout-s", str(stall_s), "--parse-processes", "1")  # fmt: skip
    with service_stack(d, planner_args=args) as stack:
        yield stack


class Stalls:
    """Streams opened and left stalled by a client that never sends (uploads) or never reads
    (watches, result streams); `close` lets them go."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.channels: list[grpc.Channel] = []
        self.calls: list[Any] = []
        self.release = threading.Event()

    def _stub(self) -> pb_grpc.PlannerStub:
        if len(self.calls) % _STREAMS_PER_CHANNEL == 0:
            options = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own
            self.channels.append(grpc.insecure_channel(f"127.0.0.1:{self.port}", options))
        return pb_grpc.PlannerStub(self.channels[-1])

    def _nothing(self) -> Iterator[pb.AddRequestsChunk]:
        self.release.wait()
        yield from ()

    def uploads(self, n: int) -> None:
        for _ in range(n):
            self.calls.append(self._stub().AddRequests.future(self._nothing()))

    def watches(self, job_id: str, n: int, timeout: float | None = None) -> None:
        for _ in range(n):
            request = pb.WatchJobRequest(job_id=job_id)
            self.calls.append(self._stub().WatchJob(request, timeout=timeout))

    def readers(self, job_id: str, n: int) -> None:
        for _ in range(n):
            request = pb.StreamResultsRequest(job_id=job_id, follow=True)
            self.calls.append(self._stub().StreamResults(request))

    def ended(self, code: grpc.StatusCode) -> int:
        return sum(1 for call in self.calls if call.done() and call.code() == code)

    def open(self) -> list[Any]:
        return [call for call in self.calls if not call.done()]

    def close(self) -> None:
        self.release.set()
        for call in self.calls:
            call.cancel()
        for ch in self.channels:
            ch.close()


@contextmanager
def stalls(stack: ServiceStack) -> Iterator[Stalls]:
    opened = Stalls(stack.port)
    try:
        yield opened
    finally:
        opened.close()


def refused_beyond_the_cap(opened: Stalls, n: int) -> None:
    """Waits for every stream over the cap to be refused; the first CAP stay open."""
    refused = grpc.StatusCode.RESOURCE_EXHAUSTED
    wait_until(lambda: opened.ended(refused) >= n - CAP, 120, f"{n - CAP} streams refused")
    assert len(opened.open()) == CAP


def short_calls_answer(port: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="prefixgrove.v1.Planner"), timeout=ANSWER_S
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        planner = pb_grpc.PlannerStub(ch)
        assert planner.GetQueueDepth(pb.GetQueueDepthRequest(), timeout=ANSWER_S).depth >= 0
        assert planner.ListJobs(pb.ListJobsRequest(limit=1), timeout=ANSWER_S) is not None


def cap_admits_again(port: int, job_id: str) -> None:
    """Waits until CAP new watches each get their first message: every slot, and its thread, is
    back (whether the stalled clients ever learn that their streams ended or not)."""
    wait_until(lambda: _admitted(port, job_id, CAP), 120, f"{CAP} streams admitted again")


def _admitted(port: int, job_id: str, n: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.PlannerStub(ch)
        watches = [stub.WatchJob(pb.WatchJobRequest(job_id=job_id)) for _ in range(n)]
        try:
            return all(next(w).id == job_id for w in watches)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # type: ignore[attr-defined]
                return False
            raise
        finally:
            for w in watches:
                w.cancel()


def running_job(stack: ServiceStack, lines: int = 2) -> str:
    """A sealed job no worker runs: it stays in progress."""
    client = stack.client()
    job = client.create_job()
    body = [batch_line(f"r{i}", {"prompt": f"Say {i}", "max_tokens": 2}).encode()
            for i in range(lines)]  # fmt: skip
    client.add_lines(job.id, body)
    client.seal(job.id)
    client.close()
    return job.id


def job_with_large_answers(stack: ServiceStack) -> str:
    """A running job whose answered lines are more than a reader that reads nothing takes in."""
    job_id = running_job(stack, _RESULT_LINES)
    store = JobStore(connect(stack.redis.url))
    for i in range(_RESULT_LINES):
        store.write_results(job_id, [(i, ResultRecord(False, _RESULT_LINE), 1)])
    return job_id


# --- while they stall ---------------------------------------------------------------------------
# each kind of stream, opened by the hundred and left stalled
STALL_HUNDREDS: dict[str, Callable[[Stalls, ServiceStack], None]] = {
    "uploads": lambda s, stack: s.uploads(HUNDREDS),
    "watchers": lambda s, stack: s.watches(running_job(stack), HUNDREDS),
    "result-readers": lambda s, stack: s.readers(job_with_large_answers(stack), HUNDREDS),
}


@pytest.mark.parametrize("kind", STALL_HUNDREDS)
def test_short_calls_answer_while_hundreds_of_streams_of_one_kind_stall(
    tmp_path: Path, kind: str
) -> None:
    with planner(tmp_path, upload_idle_s=PATIENT, stall_s=PATIENT) as stack, stalls(stack) as s:
        STALL_HUNDREDS[kind](s, stack)
        refused_beyond_the_cap(s, HUNDREDS)
        short_calls_answer(stack.port)
        assert len(s.open()) == CAP  # still stalled


def test_an_upload_beyond_the_cap_is_refused_naming_it(tmp_path: Path) -> None:
    with planner(tmp_path, upload_idle_s=PATIENT, stall_s=PATIENT) as stack, stalls(stack) as s:
        s.uploads(CAP + 1)
        refused_beyond_the_cap(s, CAP + 1)
        [refused] = [c for c in s.calls if c.done()]
        assert f"--max-streams {CAP}" in refused.details()


def test_short_calls_answer_while_the_cap_is_full_of_watchers_and_hundreds_of_uploads_wait(
    tmp_path: Path,
) -> None:
    with planner(tmp_path, upload_idle_s=PATIENT, stall_s=PATIENT) as stack, stalls(stack) as s:
        s.watches(running_job(stack), CAP)
        s.uploads(HUNDREDS)
        refused_beyond_the_cap(s, CAP + HUNDREDS)
        short_calls_answer(stack.port)
        assert len(s.open()) == CAP


# --- at their timeout ---------------------------------------------------------------------------
def test_stalled_uploads_give_their_threads_back_at_the_idle_upload_timeout(
    tmp_path: Path,
) -> None:
    with planner(tmp_path, upload_idle_s=SHORT, stall_s=PATIENT) as stack, stalls(stack) as s:
        job_id = running_job(stack)
        s.uploads(HUNDREDS)
        wait_until(lambda: not s.open(), 120, "every stalled upload to end")
        assert s.ended(grpc.StatusCode.CANCELLED) == CAP  # ended by the planner
        cap_admits_again(stack.port, job_id)
        short_calls_answer(stack.port)


def test_stalled_result_readers_give_their_threads_back_at_the_stall_timeout(
    tmp_path: Path,
) -> None:
    with planner(tmp_path, upload_idle_s=PATIENT, stall_s=SHORT) as stack, stalls(stack) as s:
        job_id = job_with_large_answers(stack)
        s.readers(job_id, HUNDREDS)
        refused_beyond_the_cap(s, HUNDREDS)
        # NOTE: a client that reads nothing never sees its stream end (gRPC hands it the status
        # after the messages it holds), so the planner's side is what is checked
        cap_admits_again(stack.port, job_id)
        short_calls_answer(stack.port)


def test_watchers_give_their_threads_back_at_their_deadline(tmp_path: Path) -> None:
    with planner(tmp_path, upload_idle_s=PATIENT, stall_s=PATIENT) as stack, stalls(stack) as s:
        job_id = running_job(stack)
        s.watches(job_id, HUNDREDS, timeout=SHORT * 2)
        wait_until(lambda: not s.open(), 120, "every watch to reach its deadline")
        assert s.ended(grpc.StatusCode.DEADLINE_EXCEEDED) == CAP
        cap_admits_again(stack.port, job_id)
