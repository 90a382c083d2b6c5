"""Clients the campaign starts as processes of their own and kills with SIGKILL, as a hostile or
unlucky user's would die:

    fault_client.py upload TARGET KEY INPUT LINES
        creates the job of INPUT under idempotency key KEY, as `prefixgrove submit` does (with the
        input's fingerprint), sends its first LINES request lines placed from line 0, then keeps
        the stream open and sends nothing more: a client that dies mid-upload;
    fault_client.py stall TARGET JOB_ID UPLOADS WATCHES
        opens UPLOADS uploads that never send a chunk and WATCHES watches of JOB_ID that never
        read a message, and holds them.

Each prints one line once its streams are open, then waits to be killed."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefixgrove.planner.client import PlannerClient
from prefixgrove.planner.input_digest import fingerprint, is_request_line
from prefixgrove.planner.security import channel
from prefixgrove.settings import SecuritySettings
from prefixgrove_proto import planner_pb2 as pb
from prefixgrove_proto import planner_pb2_grpc as pb_grpc

_FOREVER = threading.Event()  # never set: the process waits for its SIGKILL


def upload(target: str, key: str, path: Path, lines: int) -> None:
    content = [line.rstrip(b"\r\n") for line in path.open("rb")]
    client = PlannerClient(target)
    job = client.create_job(idempotency_key=key, fingerprint=fingerprint(content))
    head = [line for line in content if is_request_line(line)][:lines]

    def chunks() -> Iterator[pb.AddRequestsChunk]:
        yield pb.AddRequestsChunk(job_id=job.id, lines=head, first_line=0)
        _FOREVER.wait()

    stub = pb_grpc.PlannerStub(client.channel)
    call = stub.AddRequests.future(chunks())
    print(f"uploading {job.id}", flush=True)
    _hold(call)


def stall(target: str, job_id: str, uploads: int, watches: int) -> None:
    stub = pb_grpc.PlannerStub(channel(target, SecuritySettings()))

    def nothing() -> Iterator[pb.AddRequestsChunk]:
        _FOREVER.wait()
        yield pb.AddRequestsChunk()

    calls = [stub.AddRequests.future(nothing()) for _ in range(uploads)]
    calls += [stub.WatchJob(pb.WatchJobRequest(job_id=job_id)) for _ in range(watches)]
    print(f"holding {uploads} uploads and {watches} watches", flush=True)
    _hold(calls)


def _hold(calls: Any) -> None:
    """Keeps the calls referenced (a call collected is cancelled) until the process is killed."""
    _FOREVER.wait()
    del calls


def main(argv: list[str]) -> None:
    mode, target, *rest = argv
    if mode == "upload":
        upload(target, rest[0], Path(rest[1]), int(rest[2]))
    elif mode == "stall":
        stall(target, rest[0], int(rest[1]), int(rest[2]))
    else:
        raise SystemExit(f"mode {mode!r}: expected upload or stall")


if __name__ == "__main__":
    main(sys.argv[1:])
