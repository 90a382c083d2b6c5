"""The groups a worker holds (its flights), by (job id, group id): each group's requests, those still
to answer, and what they hold of the engine (sequences and KV tokens) for the lease budget.

A request's id in the engine is `job_id/group_id/line index`, so an output, an abort or a suspect
leads back to its flight.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prefixgrove.jobs.prompt_parts import PARTS
from prefixgrove.jobs.redis_store.queue import Lease
from prefixgrove.jobs.redis_store.schema import RequestRecord
from prefixgrove.worker.lease_budget import Held

GroupKey = tuple[str, str]  # (job id, group id)


def request_id(lease: Lease, index: int) -> str:
    return f"{lease.job_id}/{lease.group_id}/{index}"


def group_of(request_id: str) -> GroupKey:
    job_id, group_id, _ = request_id.split("/")
    return job_id, group_id


@dataclass
class InFlight:
    lease: Lease
    requests: dict[str, tuple[int, RequestRecord]]  # engine request id -> (line index, record)
    outstanding: set[str] = field(default_factory=set)
    prefix_len: int = 0  # tokens its requests share (their KV is held once)
    # request id -> deaths it was running alone at (kept while it runs alone again)
    strikes: dict[str, int] = field(default_factory=dict)
    blamed: int = 0  # failed deliveries that caught one of its requests running alone
    # request id -> the most KV tokens it holds beyond the shared prefix
    kv_tokens: dict[str, int] = field(default_factory=dict)
    leased_at: float = 0.0  # time.monotonic() at the lease

    @property
    def key(self) -> GroupKey:
        return self.lease.job_id, self.lease.group_id

    def held(self) -> tuple[int, int]:
        """(sequences, KV tokens) of what is still to answer."""
        if not self.outstanding:
            return 0, 0
        tokens = self.prefix_len + sum(self.kv_tokens[r] for r in self.outstanding)
        return sum(samples(self.requests[r][1]) for r in self.outstanding), tokens


class Flights:
    """The flights in the order they were leased."""

    def __init__(self) -> None:
        self._by_group: dict[GroupKey, InFlight] = {}

    def __len__(self) -> int:
        return len(self._by_group)

    def __iter__(self) -> Iterator[InFlight]:
        return iter(self._by_group.values())

    def __getitem__(self, key: GroupKey) -> InFlight:
        return self._by_group[key]

    def add(self, flight: InFlight) -> None:
        self._by_group[flight.key] = flight

    def pop(self, lease: Lease) -> InFlight | None:
        return self._by_group.pop((lease.job_id, lease.group_id), None)

    def of(self, request_id: str) -> InFlight:
        """The flight of a request (KeyError once it is gone)."""
        return self._by_group[group_of(request_id)]

    def outstanding(self, request_id: str) -> tuple[int, RequestRecord] | None:
        """(line index, record) of a request this worker still has to answer."""
        flight = self._by_group.get(group_of(request_id))
        if flight is None or request_id not in flight.outstanding:
            return None
        return flight.requests[request_id]

    def held(self) -> Held:
        sequences = tokens = 0
        for flight in self._by_group.values():
            n, t = flight.held()
            sequences += n
            tokens += t
        return Held(len(self._by_group), sequences, tokens)


def shared_prefix(prefix_len: int, accepted: list[RequestRecord]) -> int:
    """The prefix the engine shares among all of the group's accepted requests, as the local run
    groups them (none for a group left with one; each request keeps a token of its own; one asking
    for prompt logprobs runs outside the group), so that any part of the group run later, even a
    single request, shares the same prefix."""
    if len(accepted) < 2:
        return 0
    shared = [r for r in accepted if r.params.get("prompt_logprobs") is None]
    own_token_after = [len(r.prompt_token_ids) - 1 for r in shared]
    return max(0, min(prefix_len, *own_token_after)) if own_token_after else 0


def samples(record: RequestRecord) -> int:
    """The sequences a request runs: n per prompt (a line may hold several: prompt_parts.py)."""
    return int(record.params.get("n") or 1) * max(1, len(record.params.get(PARTS) or ()))


def own_kv_tokens(record: RequestRecord, prefix_len: int, max_model_len: int) -> int:
    """The most KV a request holds beyond its group's shared prefix: its own prompt tokens and
    the tokens it may generate, for each of its samples."""
    prompt = len(record.prompt_token_ids)
    limit = max(max_model_len - prompt, 0)
    new = min(record.params.get("max_tokens") or limit, limit)
    return (prompt - prefix_len + new) * samples(record)
