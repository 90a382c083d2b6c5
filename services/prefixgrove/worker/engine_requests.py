"""The requests a worker has handed to its engine and not had back: handed over with their group's
prefix, aborted, answered."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from prefixgrove.grouping import PrefixGroup
from prefixgrove.jobs.prompt_parts import split
from prefixgrove.jobs.redis_store.schema import RequestRecord
from prefixgrove.jobs.sampling_fields import sampling_kwargs
from prefixgrove.worker.engine_protocol import Engine, NewRequest
from prefixgrove.worker.flights import InFlight

if TYPE_CHECKING:
    from prefixgrove.engine import SamplingParams


class EngineRequests:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ids: set[str] = set()  # request ids the engine holds now

    def __bool__(self) -> bool:
        return bool(self.ids)

    def add(self, flight: InFlight, request_ids: list[str]) -> None:
        """Hands these requests of the group to the engine, with the group's prefix when it has
        one: the same arithmetic whether they run beside all of their group or alone."""
        self.ids.update(request_ids)
        requests: list[NewRequest] = []
        for rid in request_ids:
            record = flight.requests[rid][1]
            requests.append((rid, token_ids(record), sampling_params(record)))
        if flight.prefix_len:
            shared = PrefixGroup(flight.prefix_len, tuple(range(len(requests))))
            group_id = f"{flight.lease.job_id}/{flight.lease.group_id}"
            self.engine.add_group(group_id, shared, requests)
            return
        for request in requests:
            self.engine.add_request(*request)

    def answered(self, request_id: str) -> None:
        self.ids.discard(request_id)

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort(request_ids)
        self.ids.difference_update(request_ids)

    def drop(self, flight: InFlight) -> None:
        """Aborts what the flight has still to answer; it then answers nothing more."""
        self.abort(list(flight.outstanding))
        flight.outstanding.clear()


def sampling_params(record: RequestRecord) -> SamplingParams:
    from prefixgrove.engine import SamplingParams

    return SamplingParams(**sampling_kwargs(record.params))


def token_ids(record: RequestRecord) -> Sequence[int]:
    """The record's prompt, an int32 array (the engine takes arrays as it takes lists), or the
    prompts of a line of several, which the worker's PartsEngine takes (prompt_parts.py)."""
    return cast("Sequence[int]", split(record.prompt_token_ids, record.params))
