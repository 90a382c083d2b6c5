"""A call whose arguments are wrong is refused with INVALID_ARGUMENT and a message that fits in a
status, never UNKNOWN (an exception of the planner's) nor a status the client cannot read. Real
gRPC on loopback, a real redis-server."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest
from services_testbed import RedisServer, need_redis, planner_in_process

from prefixgrove_proto import planner_pb2 as pb
from prefixgrove_proto import planner_pb2_grpc as pb_grpc

OVERSIZED_ID = "job_" + "f" * (1 << 20)


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pb_grpc.PlannerStub]:
    redis = RedisServer(need_redis(), tmp_path_factory.mktemp("bad-arguments"))
    redis.start()
    try:
        with planner_in_process(redis.url) as (_, client):
            yield pb_grpc.PlannerStub(client.channel)
    finally:
        redis.kill()


def status_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as refused:
        result = call()
        if isinstance(result, Iterator):
            list(result)
    error = refused.value
    return error.code(), error.details()  # type: ignore[attr-defined]


@pytest.mark.parametrize("token", ["\u00b2", "9" * 5000, str(10**30), "-1", "1e3", "page-2"])
def test_a_page_token_we_never_gave_is_an_invalid_argument(
    stub: pb_grpc.PlannerStub, token: str
) -> None:
    code, details = status_of(lambda: stub.ListJobs(pb.ListJobsRequest(page_token=token)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in details
    assert len(details) < 1000


def test_a_negative_page_size_is_an_invalid_argument(stub: pb_grpc.PlannerStub) -> None:
    code, details = status_of(lambda: stub.ListJobs(pb.ListJobsRequest(limit=-1)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "limit -1" in details


CALLS_WITH_A_JOB_ID: dict[str, Callable[[pb_grpc.PlannerStub, str], object]] = {
    "GetJob": lambda s, job: s.GetJob(pb.GetJobRequest(job_id=job)),
    "CancelJob": lambda s, job: s.CancelJob(pb.CancelJobRequest(job_id=job)),
    "SealJob": lambda s, job: s.SealJob(pb.SealJobRequest(job_id=job)),
    "WatchJob": lambda s, job: s.WatchJob(pb.WatchJobRequest(job_id=job)),
    "StreamResults": lambda s, job: s.StreamResults(pb.StreamResultsRequest(job_id=job)),
    "AddRequests": lambda s, job: s.AddRequests(iter([pb.AddRequestsChunk(job_id=job)])),
}


@pytest.mark.parametrize("method", sorted(CALLS_WITH_A_JOB_ID))
def test_an_oversized_job_id_is_an_invalid_argument(stub: pb_grpc.PlannerStub, method: str) -> None:
    code, details = status_of(lambda: CALLS_WITH_A_JOB_ID[method](stub, OVERSIZED_ID))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "job_id" in details and len(details) < 1000


def test_an_unknown_job_id_of_a_sane_size_is_still_not_found(stub: pb_grpc.PlannerStub) -> None:
    code, _ = status_of(lambda: stub.GetJob(pb.GetJobRequest(job_id="job_" + "0" * 20)))
    assert code == grpc.StatusCode.NOT_FOUND


def test_an_oversized_model_name_is_refused_in_a_message_that_fits(
    stub: pb_grpc.PlannerStub,
) -> None:
    code, details = status_of(lambda: stub.CreateJob(pb.CreateJobRequest(model="m" * (1 << 20))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "model_not_found" in details
    assert len(details) < 1000
