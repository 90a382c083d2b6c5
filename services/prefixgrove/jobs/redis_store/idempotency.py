"""Idempotency keys: `pg:idem:<key>` holds the id of the job created under the key (schema.py's
table). The rules:
  - a key names one job at a time: the first CreateJob under it makes the job, every later one gets
    that job back, whatever state it is in (a job of another input is refused: InputConflict);
  - the job's record exists before the key names it, so whoever finds the key finds a job, or the
    remains of one that expired or that Redis lost: such a key is free;
  - a job whose upload failed (interrupted, abandoned, Redis out of memory; JobStore.fail_ingest)
    frees its key, so the client's next submit under it makes a clean job;
  - a finished job's key expires with the job's keys (its retention).
"""

from __future__ import annotations

from collections.abc import Callable

from prefixgrove.jobs.redis_store import schema
from prefixgrove.jobs.redis_store.connection import Redis
from prefixgrove.jobs.redis_store.schema import JobRecord, text

# KEYS: the idempotency key; ARGV: the job id, retention. Expires the key only while it still
# names this job.
_EXPIRE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# KEYS: the idempotency key; ARGV: the job id. Frees the key only while it still names this job.
# NOTE: DEL is allowed when Redis is out of memory, so a failed upload always frees its key.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: the idempotency key; ARGV: the job id it names now, the new job id. Hands the key of a
# job that is gone to a new job, unless another caller did so first. Returns 1 when it did.
_REPLACE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  return 1
end
return 0
"""


class InputConflict(ValueError):
    """A submit under a key whose job was created for another input."""


class IdempotencyKeys:
    def __init__(self, client: Redis) -> None:
        self.r = client
        self._expire = client.register_script(_EXPIRE)
        self._release = client.register_script(_RELEASE)
        self._replace = client.register_script(_REPLACE)

    def claim(
        self, key: str, job_id: str, find: Callable[[str], JobRecord | None]
    ) -> JobRecord | None:
        """Makes `key` name `job_id`, unless it names a job that still exists (`find` looks a
        job up): returns that one."""
        name = schema.idempotency_key(key)
        while True:  # each round ends, or sees another caller move the key in between
            if self.r.set(name, job_id, nx=True):
                return None
            named = self.r.get(name)
            if named is None:
                continue
            existing = find(text(named))  # type: ignore[arg-type]
            if existing is not None:
                return existing
            if self._replace(keys=[name], args=[named, job_id]):
                return None

    def release(self, key: str, job_id: str) -> None:
        self._release(keys=[schema.idempotency_key(key)], args=[job_id])

    def expire(self, key: str, job_id: str, retention_s: int) -> None:
        self._expire(keys=[schema.idempotency_key(key)], args=[job_id, retention_s])


def check_same_input(job: JobRecord, lines: int, digest: str) -> None:
    """Raises InputConflict when `job` (found under its idempotency key) was created for another
    input than the one of `lines` request lines and `digest`. A job or a submit that gave no
    fingerprint cannot be told apart: it passes, and the upload compares its lines one by one."""
    if not job.input_digest or not digest:
        return
    if (job.input_lines, job.input_digest) != (lines, digest):
        raise InputConflict(
            f"idempotency key {job.idempotency_key!r} names job {job.id}, created for another "
            f"input ({job.input_lines} request lines, digest {job.input_digest[:16]}) than this "
            f"one ({lines} request lines, digest {digest[:16]}): submit this input under another "
            "key, or leave the key out"
        )
