"""A job's upload as every planner replica shares it in Redis: the line indices handed out, the
custom_ids taken, the counts behind `job_error`, when lines last arrived and who seals it. A
replica's memory only caches the prefix index of the lines it took (jobs/ingest.py); any replica
can rebuild the whole job's index from the request records here.

Keys, beside the job's own (built on JobKeys(id).job, so they share its Cluster hash tag):
  pg:job:{<id>}:upload   hash: lines (indices handed out), json_lines, prompt_tokens, encoding (set
                         when the input is not UTF-8), touched (unix time of the last chunk or
                         seal), sealer (the planner instance sealing the job; no line is taken
                         after it)
  pg:job:{<id>}:ids      set of the custom_ids taken
  pg:job:{<id>}:digests  string: the 16-byte digest of each request line handed out, in index order
                         (planner/input_digest.py): a line sent again at its index is compared with
                         it, and the seal checks the whole input against the one the job declared
All live from CreateJob until the upload ends: the seal, a failure, an abandon or a cancel deletes
them. The jobs with an upload open are the fields of pg:ingesting (jobs/redis_store/schema.py).

Placing lines: a stream may say where its lines go (the index of its first request line). The
lines the job holds at those indices are compared with the ones sent and skipped, the rest are
handed out after them; so a client that sends the input again from its start, or two clients
sending it at once, add each line once. A stream that says nothing adds its lines after the rest.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from prefixgrove.jobs.ingest import JobPlan, ModelLines, UploadClosed, UploadCounts, plan_models
from prefixgrove.jobs.prompt_parts import groupable
from prefixgrove.jobs.redis_store import schema
from prefixgrove.jobs.redis_store.connection import Redis
from prefixgrove.jobs.redis_store.schema import JobKeys, RequestRecord, text
from prefixgrove.settings import IngestSettings

_READ_BATCH = 1000

# NOTE: planner/input_digest.py's LINE_DIGEST_BYTES (the planner's, which this module cannot import)
DIGEST_BYTES = 16
_UNKNOWN_DIGEST = bytes(DIGEST_BYTES)  # of a line reserved without its digest

# KEYS: upload, digests. ARGV: the index of the first line (-1: after the lines handed out), now,
# then each line's digest. {first index handed out, encoding or '', lines skipped}; {-1} while the
# job is being sealed; {-2, lines handed out} when the first line is past them; {-3, index} when
# the line at that index differs from the one held (nothing is handed out); nil once ended.
_PLACE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
if redis.call('HEXISTS', KEYS[1], 'sealer') == 1 then return {-1} end
local held = tonumber(redis.call('HGET', KEYS[1], 'lines'))
local first = tonumber(ARGV[1])
if first < 0 then first = held end
if first > held then return {-2, held} end
local n = #ARGV - 2
local size = n > 0 and string.len(ARGV[3]) or 0  -- every digest is as long
local overlap = math.min(held - first, n)
if overlap > 0 then
  local stored = redis.call('GETRANGE', KEYS[2], first * size, (first + overlap) * size - 1)
  for i = 1, overlap do
    if string.sub(stored, (i - 1) * size + 1, i * size) ~= ARGV[2 + i] then
      return {-3, first + i - 1}
    end
  end
end
if n > overlap then
  redis.call('APPEND', KEYS[2], table.concat(ARGV, '', 3 + overlap, 2 + n))
  redis.call('HINCRBY', KEYS[1], 'lines', n - overlap)
end
redis.call('HSET', KEYS[1], 'touched', ARGV[2])
return {held, redis.call('HGET', KEYS[1], 'encoding') or '', overlap}
"""

# KEYS: upload. ARGV: instance. Gives up the seal `instance` claimed (the job stays open).
_RELEASE_SEAL = """
if redis.call('HGET', KEYS[1], 'sealer') == ARGV[1] then redis.call('HDEL', KEYS[1], 'sealer') end
return 0
"""

# KEYS: upload, ids. ARGV: custom_ids. 1 for each id no earlier call took, else 0; nil once ended.
_FIRST_USES = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local fresh = {}
for i, id in ipairs(ARGV) do fresh[i] = redis.call('SADD', KEYS[2], id) end
return fresh
"""

# KEYS: upload. ARGV: json_lines, prompt_tokens, encoding ('' to leave it). The counts after.
_COUNT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
redis.call('HINCRBY', KEYS[1], 'json_lines', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'encoding', ARGV[3]) end
return redis.call('HMGET', KEYS[1], 'lines', 'json_lines', 'prompt_tokens', 'encoding')
"""

# KEYS: upload. ARGV: instance, the holder it may take over ('' for none), now.
# {1, counts...} when the caller seals the job now; {0, holder} while another holder seals it;
# nil once the upload has ended.
_CLAIM_SEAL = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local holder = redis.call('HGET', KEYS[1], 'sealer') or ''
if holder ~= ARGV[2] and holder ~= ARGV[1] then return {0, holder} end
redis.call('HSET', KEYS[1], 'sealer', ARGV[1], 'touched', ARGV[3])
local h = redis.call('HMGET', KEYS[1], 'lines', 'json_lines', 'prompt_tokens', 'encoding')
return {1, h[1] or '0', h[2] or '0', h[3] or '0', h[4] or ''}
"""

# KEYS: upload. ARGV: cutoff, now, a sealer known to have stopped ('' for none). 1 (and touched
# now, so one replica alone expires it) when no line arrived since `cutoff` and no live planner
# seals the job.
_CLAIM_IDLE = """
local h = redis.call('HMGET', KEYS[1], 'touched', 'sealer')
if not h[1] or (h[2] and h[2] ~= ARGV[3]) or tonumber(h[1]) > tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'touched', ARGV[2])
return 1
"""

# KEYS: job, req. Deletes the request records of a job that ended before its seal (lines written
# after it ended would otherwise outlive it): no group of it was ever queued to read them.
_DROP_UNSEALED_REQUESTS = """
local h = redis.call('HMGET', KEYS[1], 'state', 'groups_total')
local ended = h[1] == 'completed' or h[1] == 'failed' or h[1] == 'cancelled'
if not ended or tonumber(h[2] or '0') > 0 then return 0 end
return redis.call('DEL', KEYS[2])
"""


@dataclass(frozen=True)
class UploadKeys:
    job_id: str

    @property
    def upload(self) -> str:
        return JobKeys(self.job_id).job + ":upload"

    @property
    def ids(self) -> str:
        return JobKeys(self.job_id).job + ":ids"

    @property
    def digests(self) -> str:
        return JobKeys(self.job_id).job + ":digests"

    def all(self) -> list[str]:
        return [self.upload, self.ids, self.digests]


class LineDiffers(ValueError):
    """A line sent at an index the job holds differs from the line held there."""

    def __init__(self, job_id: str, index: int) -> None:
        super().__init__(f"request line {index} differs from line {index} of job {job_id}")
        self.index = index


class LineGap(ValueError):
    """A stream's first line is past the lines the job holds: those between were never sent."""

    def __init__(self, job_id: str, first: int, held: int) -> None:
        super().__init__(
            f"the stream starts at request line {first} but job {job_id} holds {held} lines: "
            f"send from line {held} or before"
        )
        self.held = held


@dataclass(frozen=True)
class SealClaim:
    """The answer to "may I seal this job?": the upload's counts when yes; else the live planner
    that seals it now, or neither when the upload has ended."""

    counts: UploadCounts | None = None
    holder: str = ""


class _LedgerScripts:
    """The scripts a ledger runs, registered once per Redis client."""

    def __init__(self, client: Redis) -> None:
        self.place = client.register_script(_PLACE)
        self.first_uses = client.register_script(_FIRST_USES)
        self.count = client.register_script(_COUNT)


class Uploads:
    def __init__(self, client: Redis) -> None:
        self.r = client
        self._ledger_scripts = _LedgerScripts(client)
        self._claim_seal = client.register_script(_CLAIM_SEAL)
        self._claim_idle = client.register_script(_CLAIM_IDLE)
        self._drop_unsealed = client.register_script(_DROP_UNSEALED_REQUESTS)
        self._release_seal = client.register_script(_RELEASE_SEAL)

    def open(self, job_id: str) -> None:
        self.r.hset(UploadKeys(job_id).upload, mapping={"lines": 0, "touched": time.time()})

    def ledger(self, job_id: str) -> RedisLedger:
        return RedisLedger(self._ledger_scripts, UploadKeys(job_id))

    def is_open(self, job_id: str) -> bool:
        return bool(self.r.exists(UploadKeys(job_id).upload))

    def close(self, job_id: str) -> None:
        self.r.delete(*UploadKeys(job_id).all())

    def open_jobs(self) -> list[str]:
        """Every job with an upload open, whichever replica takes it."""
        return [text(job) for job in self.r.hkeys(schema.INGESTING)]  # type: ignore[union-attr]

    # --- which planner streams a job in -------------------------------------------------------
    def claim_ingest(self, job_id: str, instance: str) -> None:
        self.r.hset(schema.INGESTING, job_id, instance)

    def release_ingest(self, job_id: str) -> None:
        self.r.hdel(schema.INGESTING, job_id)

    def orphaned_ingests(self) -> list[str]:
        """Jobs still streaming in whose planner has stopped beating (JobStore.heartbeat)."""
        owners = {text(k): text(v) for k, v in self.r.hgetall(schema.INGESTING).items()}  # type: ignore[union-attr]
        pipe = self.r.pipeline(transaction=False)
        for owner in owners.values():
            pipe.exists(schema.planner_key(owner))
        alive = pipe.execute()
        return [job for (job, _), live in zip(owners.items(), alive, strict=True) if not live]

    # --- sealing ------------------------------------------------------------------------------
    def claim_seal(self, job_id: str, instance: str) -> SealClaim:
        """Lets `instance` seal the job unless a live planner seals it now (one whose heartbeat
        stopped is taken over): no line is taken after this."""
        keys = [UploadKeys(job_id).upload]
        reply = self._claim_seal(keys=keys, args=[instance, "", time.time()])
        if reply and int(reply[0]) == 0:
            holder = text(reply[1])
            if self._alive(holder):
                return SealClaim(holder=holder)
            reply = self._claim_seal(keys=keys, args=[instance, holder, time.time()])
        if not reply:
            return SealClaim()
        if int(reply[0]) == 0:
            return SealClaim(holder=text(reply[1]))
        return SealClaim(counts=_counts(reply[1:]))

    def release_seal(self, job_id: str, instance: str) -> None:
        """Gives up a seal claimed and not done: the job takes lines again."""
        self._release_seal(keys=[UploadKeys(job_id).upload], args=[instance])

    def line_digests(self, job_id: str, lines: int) -> Iterator[bytes]:
        """The digests of the job's first `lines` request lines, in order, a run at a time."""
        key, step = UploadKeys(job_id).digests, _READ_BATCH * DIGEST_BYTES * 64
        for start in range(0, lines * DIGEST_BYTES, step):
            end = min(start + step, lines * DIGEST_BYTES) - 1
            yield self.r.getrange(key, start, end)  # type: ignore[misc]

    def stored(self, job_id: str) -> int:
        """Lines whose request record or error is written: every index handed out, once the
        streams that took them have finished writing."""
        keys = JobKeys(job_id)
        pipe = self.r.pipeline(transaction=False)
        pipe.hlen(keys.requests)
        pipe.hlen(keys.results)  # before the seal, only lines that failed at ingest are there
        return sum(int(n) for n in pipe.execute())

    def request_count(self, job_id: str) -> int:
        return int(self.r.hlen(JobKeys(job_id).requests))  # type: ignore[arg-type]

    def write_totals(self, job_id: str, counts: UploadCounts) -> None:
        """The job's totals as the whole upload counted them (each stream wrote its own view)."""
        totals = {"total": counts.lines, "prompt_tokens": counts.prompt_tokens}
        self.r.hset(JobKeys(job_id).job, mapping=totals)  # type: ignore[arg-type]

    def prompts(self, job_id: str, lines: int) -> Iterator[tuple[int, np.ndarray, str | None]]:
        """(line index, prompt tokens grouping may see, body's model or None) of every request
        record of the job, in line order."""
        key = JobKeys(job_id).requests
        for start in range(0, lines, _READ_BATCH):
            indices = range(start, min(start + _READ_BATCH, lines))
            blobs = self.r.hmget(key, [str(i) for i in indices])
            for index, blob in zip(indices, blobs, strict=True):  # type: ignore[call-overload]
                if blob is not None:  # a line that failed at ingest has no record
                    record = RequestRecord.decode(blob)  # type: ignore[arg-type]
                    yield index, groupable(record.prompt_token_ids, record.params), record.model

    # --- ending -------------------------------------------------------------------------------
    def claim_idle(self, job_id: str, idle_s: float, now: float) -> bool:
        """Whether the job's lines stopped arriving `idle_s` before `now` (unix seconds) and no
        live planner seals it; the first replica to ask is the one told yes."""
        key = UploadKeys(job_id).upload
        sealer = self.r.hget(key, "sealer")
        stopped = text(sealer) if sealer and not self._alive(text(sealer)) else ""  # type: ignore[arg-type]
        return bool(self._claim_idle(keys=[key], args=[now - idle_s, time.time(), stopped]))

    def _alive(self, instance: str) -> bool:
        return bool(self.r.exists(schema.planner_key(instance)))

    def drop_unsealed_requests(self, job_id: str) -> bool:
        keys = JobKeys(job_id)
        return bool(self._drop_unsealed(keys=[keys.job, keys.requests]))


class RedisLedger:
    """The UploadLedger (jobs/ingest.py) of a planner: atomic in Redis, whichever replica asks."""

    def __init__(self, scripts: _LedgerScripts, keys: UploadKeys) -> None:
        self.scripts = scripts
        self.keys = keys
        self._placed: tuple[int, int, str | None] | None = None  # (first, lines, encoding)

    def place(self, first_line: int | None, digests: Sequence[bytes]) -> int:
        """Places lines of these digests from index `first_line` (None: after the lines handed
        out), comparing and skipping those the job holds; returns how many it skipped. The next
        `reserve` hands out the rest. Raises UploadClosed, LineDiffers or LineGap."""
        if any(len(d) != DIGEST_BYTES for d in digests):
            raise ValueError(f"a line digest is {DIGEST_BYTES} bytes long")
        first = -1 if first_line is None else first_line
        job_id = self.keys.job_id
        reply = self.scripts.place(keys=[self.keys.upload, self.keys.digests],
                                   args=[first, time.time(), *digests])  # fmt: skip
        if not reply:
            raise UploadClosed(f"job {job_id} no longer takes requests")
        code = int(reply[0])
        if code == -1:
            raise UploadClosed(f"job {job_id} is being sealed: it takes no more lines")
        if code == -2:
            raise LineGap(job_id, first, int(reply[1]))
        if code == -3:
            raise LineDiffers(job_id, int(reply[1]))
        skipped = int(reply[2])
        self._placed = (code, len(digests) - skipped, text(reply[1]) or None)
        return skipped

    def reserve(self, lines: int) -> tuple[int, str | None]:
        """The lines the last `place` handed out (the caller holds the job's lock in between);
        without one, `lines` new lines after those held, whose digests are not known (no line
        sent again matches them)."""
        if self._placed is None:
            self.place(None, [_UNKNOWN_DIGEST] * lines)
        placed, self._placed = self._placed, None
        if placed is None or placed[1] != lines:
            raise RuntimeError(f"reserve({lines}) answers a place() of as many new lines")
        return placed[0], placed[2]

    def note_encoding(self, name: str) -> None:
        self._counted(0, 0, name)

    def first_uses(self, custom_ids: Sequence[str]) -> list[bool]:
        reply = self.scripts.first_uses(keys=self.keys.all(), args=list(custom_ids))
        if reply is None:
            raise UploadClosed(f"job {self.keys.job_id} no longer takes requests")
        return [bool(fresh) for fresh in reply]

    def count(self, json_lines: int, prompt_tokens: int) -> UploadCounts:
        return self._counted(json_lines, prompt_tokens, "")

    def counts(self) -> UploadCounts:
        return self._counted(0, 0, "")

    def forget_custom_ids(self) -> None:
        """They are in Redis, not in this process; they go when the upload ends."""

    def _counted(self, json_lines: int, prompt_tokens: int, encoding: str) -> UploadCounts:
        reply = self.scripts.count(
            keys=[self.keys.upload], args=[json_lines, prompt_tokens, encoding]
        )
        if not reply:
            raise UploadClosed(f"job {self.keys.job_id} no longer takes requests")
        return _counts(reply)


def rebuild_plan(
    uploads: Uploads,
    job_id: str,
    lines: int,
    settings: IngestSettings,
    default_model: str,
    aliases: Mapping[str, str] | None = None,
) -> dict[str, JobPlan]:
    """The job's plans (one per model) from its request records in Redis, built as the replica
    that took every line builds them (the same prefix indexes, in line order), so the groups are
    the same. A record whose body named no model is `default_model`'s, one naming an alias is the
    aliased model's."""
    models: dict[str, ModelLines] = {}
    aliases = aliases or {}
    for line, tokens, model in uploads.prompts(job_id, lines):
        name = default_model if model is None else aliases.get(model, model)
        models.setdefault(name, ModelLines(settings.block_size)).add(line, tokens)
    return plan_models(models, default_model, settings)


def _counts(fields: Sequence[bytes | str | None]) -> UploadCounts:
    lines, json_lines, prompt_tokens, encoding = (text(f) if f else "" for f in fields)
    return UploadCounts(int(lines or 0), int(json_lines or 0), int(prompt_tokens or 0),
                        encoding or None)  # fmt: skip
