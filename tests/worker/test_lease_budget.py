"""A worker leases what its engine can hold (requests and KV tokens, plus a little ahead), whatever
the size of a group: the budget alone, and a real worker on a real redis-server and engine."""

from __future__ import annotations

import pytest
from queued_jobs import queue_shared_prefix_job
from services_testbed import MODEL, RedisServer

from prefixgrove.engine import EngineConfig, LLMEngine
from prefixgrove.jobs.redis_store.connection import connect
from prefixgrove.jobs.redis_store.store import JobStore
from prefixgrove.settings import WorkerSettings
from prefixgrove.worker.lease_budget import Capacity, Held, LeaseBudget
from prefixgrove.worker.runner import Worker

NOTHING = Held(groups=0, requests=0, kv_tokens=0)


def test_the_first_ask_is_one_group_whose_size_sets_the_next() -> None:
    budget = LeaseBudget(Capacity(requests=512, kv_tokens=10**6), ahead=0.25)
    assert budget.groups_to_ask(NOTHING) == 1
    budget.observe(requests=16, kv_tokens=6_800)
    # 640 requests of room hold 40 groups of 16; the KV room holds far more
    assert budget.groups_to_ask(NOTHING) == 40
    assert budget.groups_to_ask(Held(groups=30, requests=480, kv_tokens=204_000)) == 10


def test_the_kv_cache_limits_when_groups_are_long() -> None:
    budget = LeaseBudget(Capacity(requests=512, kv_tokens=100_000), ahead=0.0)
    budget.observe(requests=4, kv_tokens=30_000)
    assert budget.groups_to_ask(NOTHING) == 3
    assert budget.groups_to_ask(Held(groups=3, requests=12, kv_tokens=90_000)) == 1  # overshoot
    assert budget.groups_to_ask(Held(groups=4, requests=16, kv_tokens=120_000)) == 0


def test_full_means_no_ask_and_max_groups_caps_the_count() -> None:
    budget = LeaseBudget(Capacity(requests=64, kv_tokens=10**6), ahead=0.5, max_groups=5)
    budget.observe(requests=2, kv_tokens=100)
    assert budget.groups_to_ask(Held(groups=1, requests=96, kv_tokens=0)) == 0
    assert budget.groups_to_ask(Held(groups=2, requests=4, kv_tokens=200)) == 3
    assert budget.groups_to_ask(Held(groups=5, requests=10, kv_tokens=500)) == 0


def test_one_ask_is_bounded_even_for_tiny_groups() -> None:
    budget = LeaseBudget(Capacity(requests=10**5, kv_tokens=10**9), ahead=0.0)
    budget.observe(requests=1, kv_tokens=10)
    assert 1 <= budget.groups_to_ask(NOTHING) <= 64


def engine(**limits: int) -> LLMEngine:
    config = EngineConfig.create(MODEL, device="cpu", dtype="float32", max_model_len=1024, **limits)
    return LLMEngine(config)


@pytest.mark.parametrize(
    ("limits", "per_group", "max_tokens"),
    [
        ({"max_num_seqs": 24}, 4, 16),  # the batch limits: 24 requests, 30 with the lease ahead
        ({"max_num_seqs": 256, "num_gpu_blocks_override": 40}, 4, 40),  # the KV cache limits
    ],
)
def test_a_worker_leases_what_its_engine_holds_and_no_more(
    redis_server: RedisServer, limits: dict[str, int], per_group: int, max_tokens: int
) -> None:
    store = JobStore(connect(redis_server.url))
    queue_shared_prefix_job(store, MODEL, groups=40, per_group=per_group, max_tokens=max_tokens)
    worker = Worker(WorkerSettings(redis_url=redis_server.url, model=MODEL), engine(**limits))
    worker.store.ensure_queue(MODEL)
    worker.leasing.lease_more()
    held = worker.flights.held()
    capacity, scale = worker.budget.capacity, 1 + worker.budget.ahead
    max_requests, max_tokens_held = capacity.requests * scale, capacity.kv_tokens * scale
    group_tokens = 32 + per_group * (8 + max_tokens)
    assert held.requests <= max_requests + per_group
    assert held.kv_tokens <= max_tokens_held + group_tokens
    # and it is full: one more group would pass one of the limits
    full_of_requests = held.requests + per_group > max_requests
    assert full_of_requests or held.kv_tokens + group_tokens > max_tokens_held
    assert 1 < held.groups < 40
