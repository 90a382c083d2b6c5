"""Plans and dry runs in Redis: a job marked as a dry run at its creation (its plan options in the
job hash), the shape of its requests read back at its seal, and its end as a completed job that
holds its plan instead of queued groups (schema.END_DRY_RUN); any other job's plan kept beside it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from prefixgrove.jobs.redis_store.schema import END_DRY_RUN, JobKeys, JobState, RequestRecord, text
from prefixgrove.jobs.redis_store.store import JobStore

_READ_BATCH = 1000


class DryRuns:
    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._end = store.r.register_script(END_DRY_RUN)

    def mark(self, job_id: str, options: dict[str, Any]) -> str:
        """Makes the job a dry run for `options`; returns them as the job record holds them."""
        encoded = json.dumps(options, sort_keys=True)
        self.store.r.hset(JobKeys(job_id).job, "dry_run", encoded)
        return encoded

    def requests(self, job_id: str, lines: int) -> Iterator[tuple[int, int, dict[str, Any], str | None]]:  # fmt: skip
        """(line index, prompt tokens, params, body's model or None) of every request record of
        the job, in line order."""
        key = JobKeys(job_id).requests
        for start in range(0, lines, _READ_BATCH):
            indices = range(start, min(start + _READ_BATCH, lines))
            blobs = self.store.r.hmget(key, [str(i) for i in indices])
            for index, blob in zip(indices, blobs, strict=True):  # type: ignore[call-overload]
                if blob is not None:  # a line that failed at ingest has no record
                    record = RequestRecord.decode(blob)  # type: ignore[arg-type]
                    yield index, record.prompt_token_ids.size, record.params, record.model

    def keep(self, job_id: str, plan: dict[str, Any]) -> None:
        """Keeps a job's plan beside it (a job that runs: its ETA starts from it)."""
        self.store.r.hset(JobKeys(job_id).job, "plan", json.dumps(plan))

    def end(self, job_id: str, plan: dict[str, Any], saved: int) -> JobState:
        """Ends the validating dry run as completed, holding `plan`."""
        result, idempotency_key, retention_s = self._end(
            keys=JobKeys(job_id).all(), args=[time.time(), json.dumps(plan), saved]
        )
        if idempotency_key:  # the keys expire with the job, the key in its own slot too
            self.store.keys.expire(text(idempotency_key), job_id, int(retention_s))
        return JobState(text(result))
