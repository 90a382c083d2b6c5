"""The engine as a worker drives it: what its loop, its lease budget and its results read of the
engine, and nothing more. `LLMEngine` is the engine; the fault tests wrap it (one poisoned request
makes it fail) and the isolation tests stand in for it.

The rules a worker counts on:
- `validate` raises ValueError, naming the fault, for a request that `add_request`/`add_group`
  would refuse, and queues nothing.
- `add_group` computes the group's prefix once for its requests; `add_request` runs one alone.
  Request ids are the worker's own, unique while the engine holds them.
- `step` returns the requests that finished. It may raise: then every request it holds is a
  suspect (isolation_policy.py), and the worker aborts them all.
- `abort` stops requests; an output of one may still come back from a later `step`, and the
  worker drops it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # types only: importing the engine loads torch
    from prefixgrove.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
    from prefixgrove.grouping import PrefixGroup

# A request as add_group takes it: (request_id, prompt_token_ids, params).
NewRequest = tuple[str, Sequence[int], "SamplingParams"]


class EngineBlocks(Protocol):
    """The engine's KV cache, as the lease budget sizes it."""

    @property
    def num_usable(self) -> int: ...


class EngineCounters(Protocol):
    """Running totals of the engine, read into the worker's counters."""

    @property
    def prefill_tokens(self) -> int: ...  # prompt tokens whose KV was computed

    @property
    def prefix_tokens_reused(self) -> int: ...  # prompt tokens taken from a shared prefix


class Engine(Protocol):
    @property
    def config(self) -> EngineConfig: ...

    @property
    def blocks(self) -> EngineBlocks: ...

    @property
    def metrics(self) -> EngineCounters: ...

    @property
    def tokenizer(self) -> Any: ...  # what success_line detokenizes with (None: ids only)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams, /) -> list[int]: ...

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, /
    ) -> None: ...

    def add_group(
        self, group_id: str, group: PrefixGroup, requests: Sequence[NewRequest], /
    ) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_ids: Sequence[str], /) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def kv_cache_usage(self) -> float: ...  # share of the usable KV blocks held, 0 to 1

    def num_running_requests(self) -> int: ...

    def num_waiting_requests(self) -> int: ...


if TYPE_CHECKING:

    def _llm_engine_is_an_engine(engine: LLMEngine) -> Engine:
        return engine  # mypy holds LLMEngine to this protocol here
