"""A thin client of the Planner service (the CLI, tests and scripts use it)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import grpc
from prefixgrove_proto import planner_pb2 as pb
from prefixgrove_proto import planner_pb2_grpc as pb_grpc

from prefixgrove.planner.security import channel
from prefixgrove.settings import SecuritySettings

_CHUNK_BYTES = 1 << 20
TERMINAL = (pb.JOB_STATE_COMPLETED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)


def state_name(state: int) -> str:
    return pb.JobState.Name(state).removeprefix("JOB_STATE_").lower()


class PlannerClient:
    def __init__(
        self, target: str, security: SecuritySettings | None = None, tls: bool = False
    ) -> None:
        self.channel = channel(target, security or SecuritySettings(), tls=tls)
        self.stub = pb_grpc.PlannerStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def create_job(
        self, model: str = "", idempotency_key: str = "", metadata: dict[str, str] | None = None
    ) -> pb.Job:
        request = pb.CreateJobRequest(
            model=model, idempotency_key=idempotency_key, metadata=metadata or {}
        )
        return self.stub.CreateJob(request)

    def add_lines(self, job_id: str, lines: Iterable[bytes]) -> pb.AddRequestsResponse:
        """Streams lines in chunks of about 1 MiB; gRPC flow control paces the sender."""

        def chunks() -> Iterator[pb.AddRequestsChunk]:
            batch: list[bytes] = []
            size = 0
            for line in lines:
                batch.append(line)
                size += len(line)
                if size >= _CHUNK_BYTES:
                    yield pb.AddRequestsChunk(job_id=job_id, lines=batch)
                    batch, size = [], 0
            yield pb.AddRequestsChunk(job_id=job_id, lines=batch)

        return self.stub.AddRequests(chunks())

    def seal(self, job_id: str) -> pb.Job:
        return self.stub.SealJob(pb.SealJobRequest(job_id=job_id))

    def get(self, job_id: str) -> pb.Job:
        return self.stub.GetJob(pb.GetJobRequest(job_id=job_id))

    def list(self, limit: int = 100) -> list[pb.Job]:
        return list(self.stub.ListJobs(pb.ListJobsRequest(limit=limit)).jobs)

    def watch(self, job_id: str) -> Iterator[pb.Job]:
        return self.stub.WatchJob(pb.WatchJobRequest(job_id=job_id))

    def cancel(self, job_id: str) -> pb.Job:
        return self.stub.CancelJob(pb.CancelJobRequest(job_id=job_id))

    def queue_depth(self, model: str = "") -> pb.QueueDepth:
        return self.stub.GetQueueDepth(pb.GetQueueDepthRequest(model=model))

    def results(
        self,
        job_id: str,
        offset: int = 0,
        kind: pb.ResultKind = pb.RESULT_KIND_ALL,
        follow: bool = False,
    ) -> Iterator[pb.ResultLine]:
        request = pb.StreamResultsRequest(job_id=job_id, offset=offset, kind=kind, follow=follow)
        return self.stub.StreamResults(request)

    def submit_file(self, path: Path, model: str = "", idempotency_key: str = "") -> pb.Job:
        job = self.create_job(model, idempotency_key)
        if job.state != pb.JOB_STATE_VALIDATING:
            return job  # the key was used before: that job goes on as it is
        with path.open("rb") as f:
            self.add_lines(job.id, (line.rstrip(b"\r\n") for line in f))
        return self.seal(job.id)

    def download(self, job_id: str, output: Path, errors: Path) -> tuple[int, int]:
        """Writes the job's output and error files. An interrupted download resumes where it
        stopped: `<output>.offset` holds the next input index and both files' sizes meanwhile."""
        marker = output.with_name(output.name + ".offset")
        offset, sizes = 0, (0, 0)
        if marker.exists() and output.exists() and errors.exists():
            offset, out_size, err_size = (int(v) for v in marker.read_text().split())
            sizes = (out_size, err_size)
        counts = [0, 0]
        with (
            output.open("ab" if offset else "wb") as out,
            errors.open("ab" if offset else "wb") as err,
        ):
            out.truncate(sizes[0])
            err.truncate(sizes[1])
            for n, line in enumerate(self.results(job_id, offset, pb.RESULT_KIND_ALL, follow=True)):
                (err if line.is_error else out).write(line.line.encode() + b"\n")
                counts[line.is_error] += 1
                if n % 1000 == 999:
                    out.flush()
                    err.flush()
                    marker.write_text(f"{line.index + 1} {out.tell()} {err.tell()}")
        marker.unlink(missing_ok=True)
        return counts[0], counts[1]


def is_unavailable(exc: grpc.RpcError) -> bool:
    return exc.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
