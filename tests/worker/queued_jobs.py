"""A job queued straight into Redis, as a planner leaves it once sealed: groups of requests that
share a prefix each, as token ids of the tiny model's vocabulary, ready for a worker to lease."""

from __future__ import annotations

import numpy as np

from prefixgrove.jobs.ingest import JobPlan
from prefixgrove.jobs.redis_store.schema import GroupRecord, JobKeys, RequestRecord
from prefixgrove.jobs.redis_store.store import JobStore

PREFIX_TOKENS = 32  # the prefix each group shares


def queue_shared_prefix_job(
    store: JobStore,
    model: str,
    *,
    groups: int,
    per_group: int,
    max_tokens: int,
    own_tokens: int = 8,
) -> str:
    """A started job of `groups` groups of `per_group` greedy requests (`max_tokens` each, EOS
    ignored) sharing a PREFIX_TOKENS-token prefix, `own_tokens` tokens each after it; request i
    is line i, custom_id `r{i}`. Returns the job's id."""
    job, _ = store.create_job(model)
    params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
              "detokenize": False}  # fmt: skip
    records, units = {}, []
    for g in range(groups):
        prefix = (np.arange(PREFIX_TOKENS, dtype=np.int32) * 7 + g) % 256
        indices = list(range(g * per_group, (g + 1) * per_group))
        for i in indices:
            own = (np.arange(own_tokens, dtype=np.int32) * 13 + i) % 256
            tokens = np.concatenate([prefix, own])
            records[str(i)] = RequestRecord(f"r{i}", "completions", params, tokens).encode()
        units.append(GroupRecord(PREFIX_TOKENS, indices))
    keys = JobKeys(job.id)
    store.r.hset(keys.requests, mapping=records)
    store.r.hset(keys.job, "total", len(records))
    store.queue_plan(job.id, model, JobPlan(units, 0, groups))
    return job.id
