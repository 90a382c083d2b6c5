"""Everything the planner and the workers keep in Redis: keys, typed records with encode/decode, and the
Lua scripts that move counters exactly once.

Layout (prefix `pg:`; `{...}` in a key is a literal Redis Cluster hash tag, `<...>` a value):
  pg:jobs                   sorted set of job ids by creation time
  pg:idem:<key>             job id created under an idempotency key (idempotency.py: freed when
                            the job's upload fails, expires with the job)
  pg:job:{<id>}             hash: JobRecord, and model_groups: {model: [first, end)}, the run of
                            group ids each model's queue holds (a job may mix models); a dry
                            run's options and, once sealed, its plan (dry_runs.py)
  pg:job:{<id>}:req         hash: line index -> RequestRecord
  pg:job:{<id>}:grp         hash: group id -> GroupRecord; `<group id>:alone` ->
                            "index:delivery:strikes:blamed" of the request a worker last ran alone
                            (a worker that dies then blames it; a second strike fails it)
  pg:job:{<id>}:res         hash: line index -> ResultRecord (first write wins)
  pg:job:{<id>}:leased      set of group ids a worker holds now
  pg:job:{<id>}:done        set of group ids finished (or dropped by a cancel)
  pg:queue:<model>          stream of {job, group, prefix}; consumer group `workers`; an entry given
                            back is pending under the consumer `given-back`, one sent to the worker
                            holding its prefix under `for:<worker>`, until a worker claims it
  pg:holds:<model>:<worker>, pg:holders:<model>: the prefixes workers hold (affinity.py)
  pg:models                 set of models that have a queue
  pg:active:<model>         set of job ids with groups on the model's queue, not known finished yet
  pg:ingesting              hash: job id -> planner streaming its input in (uploads.py: its keys)
  pg:planner:<instance>     a live planner's heartbeat (expires when it stops)

Cluster rules: every key of one job carries the job id as its hash tag, so they share one slot and
each script below is given all the keys it touches (JobKeys.all()). Nothing else is touched by more
than one key at once: the per-model, per-planner and global keys take single-key commands, and the
pipelines that mix slots are not transactions.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PREFIX = "pg:"
CONSUMER_GROUP = "workers"
GIVEN_BACK = "given-back"  # the consumer holding groups given back, claimable at once
JOBS = PREFIX + "jobs"
MODELS = PREFIX + "models"
INGESTING = PREFIX + "ingesting"


class JobState(enum.StrEnum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)

    @property
    def runnable(self) -> bool:
        """Whether a worker should run this job's groups."""
        return self in (JobState.VALIDATING, JobState.IN_PROGRESS)


class _JobKey:
    """A key beside a job's hash: the hash's name and a suffix, so that it inherits the hash tag."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix

    def __get__(self, keys: JobKeys, owner: type[JobKeys]) -> str:
        return f"{keys.job}:{self.suffix}"


@dataclass(frozen=True)
class JobKeys:
    job_id: str

    requests = _JobKey("req")
    groups = _JobKey("grp")
    results = _JobKey("res")
    leased = _JobKey("leased")
    done = _JobKey("done")

    @property
    def job(self) -> str:
        """The job hash, and the base of every other key of the job."""
        return f"{PREFIX}job:{{{self.job_id}}}"

    def all(self) -> list[str]:
        return [self.job, self.requests, self.groups, self.results, self.leased, self.done]


def idempotency_key(key: str) -> str:
    return f"{PREFIX}idem:{key}"


def planner_key(instance: str) -> str:
    return f"{PREFIX}planner:{instance}"


def queue_key(model: str) -> str:
    return f"{PREFIX}queue:{model}"


def active_key(model: str) -> str:
    return f"{PREFIX}active:{model}"


@dataclass
class JobRecord:
    id: str
    model: str
    state: JobState = JobState.VALIDATING
    idempotency_key: str = ""
    total: int = 0
    completed: int = 0
    failed: int = 0
    groups_total: int = 0
    groups_done: int = 0
    prefix_tokens_saved: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    retention_s: int = 0  # a finished job's keys expire this long after it finished; 0: never
    input_lines: int = 0  # the request lines of the input its client declared (0: none declared)
    input_digest: str = ""  # and their digest (planner/input_digest.py)
    created_at: float = 0.0
    in_progress_at: float = 0.0
    finished_at: float = 0.0
    error_code: str = ""
    error_message: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    dry_run: str = ""  # set: a dry run, planned for these options (JSON; dry_runs.py)
    plan: str = ""  # a dry run's plan once sealed (JSON of jobs/job_estimate.py's JobEstimate)

    def encode(self) -> dict[str, str]:
        out = {k: str(v) for k, v in asdict(self).items() if k != "metadata"}
        out["state"] = self.state.value
        out["metadata"] = json.dumps(self.metadata)
        return out

    @classmethod
    def decode(cls, raw: dict[bytes, bytes] | dict[str, str]) -> JobRecord:
        h = {text(k): text(v) for k, v in raw.items()}
        ints = ("total", "completed", "failed", "groups_total", "groups_done",
                "prefix_tokens_saved", "prompt_tokens", "completion_tokens", "retention_s",
                "input_lines")  # fmt: skip
        floats = ("created_at", "in_progress_at", "finished_at")
        numbers: dict[str, Any] = {k: int(h.get(k) or 0) for k in ints}
        numbers.update({k: float(h.get(k) or 0.0) for k in floats})
        return cls(
            id=h["id"],
            model=h["model"],
            state=JobState(h["state"]),
            idempotency_key=h.get("idempotency_key", ""),
            input_digest=h.get("input_digest", ""),
            error_code=h.get("error_code", ""),
            error_message=h.get("error_message", ""),
            metadata=json.loads(h.get("metadata") or "{}"),
            dry_run=h.get("dry_run", ""),
            plan=h.get("plan", ""),
            **numbers,
        )


@dataclass(frozen=True)
class RequestRecord:
    """A validated, tokenized request as a worker needs it."""

    custom_id: str
    endpoint: str  # "completions" | "chat"
    params: dict[str, Any]
    prompt_token_ids: np.ndarray  # int32
    model: str | None = None  # the body's model, which the output line names

    def encode(self) -> bytes:
        fields = {"c": self.custom_id, "e": self.endpoint, "p": self.params}
        if self.model is not None:
            fields["m"] = self.model
        head = json.dumps(fields).encode()
        tokens = np.ascontiguousarray(self.prompt_token_ids, dtype="<i4").tobytes()
        return struct.pack("<I", len(head)) + head + tokens

    @classmethod
    def decode(cls, blob: bytes) -> RequestRecord:
        (n,) = struct.unpack_from("<I", blob)
        head = json.loads(blob[4 : 4 + n])
        tokens = np.frombuffer(blob, dtype="<i4", offset=4 + n)
        return cls(head["c"], head["e"], head["p"], tokens, head.get("m"))


@dataclass(frozen=True)
class GroupRecord:
    """A unit of work: requests (by line index) that share their first prefix_len tokens."""

    prefix_len: int
    indices: list[int]

    def encode(self) -> str:
        return json.dumps({"p": self.prefix_len, "i": self.indices})

    @classmethod
    def decode(cls, blob: bytes | str) -> GroupRecord:
        obj = json.loads(blob)
        return cls(obj["p"], obj["i"])


@dataclass(frozen=True)
class ResultRecord:
    """One answered request: an output line, or an error-file line."""

    is_error: bool
    line: str

    def encode(self) -> bytes:
        return (b"e" if self.is_error else b"o") + self.line.encode()

    @classmethod
    def decode(cls, blob: bytes) -> ResultRecord:
        return cls(blob[:1] == b"e", blob[1:].decode())


def text(value: bytes | str) -> str:
    """A Redis reply's value as str: bytes from a client that returns them, str as it is."""
    return value.decode() if isinstance(value, bytes) else value


# The job scripts (WRITE_RESULTS, FINISH_GROUP, MARK_LEASED, CANCEL, FAIL, START) take KEYS =
# JobKeys(id).all(): job, req, grp, res, leased, done, and answer {result, idempotency key,
# retention} through reply(). reply() first retains:
# once the job is terminal, every key of KEYS that has no TTL yet gets the job's retention (a key
# created after the job finished, e.g. a late result, gets it too). The call that gives the job
# hash its TTL also names the job's idempotency key and the retention: that key lives in another
# slot, so the caller expires it (idempotency.py); otherwise the two are '' and 0.
_REPLY = """
local function retain()
  local h = redis.call('HMGET', KEYS[1], 'state', 'retention_s', 'idempotency_key')
  local ttl = tonumber(h[2] or '0') or 0
  if ttl <= 0 or (h[1] ~= 'completed' and h[1] ~= 'failed' and h[1] ~= 'cancelled') then
    return {'', 0}
  end
  local first = redis.call('TTL', KEYS[1]) == -1
  for _, key in ipairs(KEYS) do
    if redis.call('TTL', key) == -1 then redis.call('EXPIRE', key, ttl) end
  end
  if first and h[3] and h[3] ~= '' then return {h[3], ttl} end
  return {'', 0}
end

local function reply(result)
  local idem = retain()
  return {result, idem[1], idem[2]}
end
"""

# The job is gone (expired, or deleted): a script that would write into it recreates nothing.
_UNLESS_GONE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return reply(0) end
"""


def _job_script(body: str, *, unless_gone: bool = False) -> str:
    """A job script: reply() beside `body`, and with `unless_gone` nothing done on a job gone."""
    return _REPLY + (_UNLESS_GONE if unless_gone else "") + body


# ARGV: now, then (index, blob, failed 0|1, completion_tokens) per result.
# A result already written is left as it was and moves no counter. Result: how many were new.
WRITE_RESULTS = _job_script(
    """
local written, completed, failed, tokens = 0, 0, 0, 0
for i = 2, #ARGV, 4 do
  if redis.call('HSETNX', KEYS[4], ARGV[i], ARGV[i + 1]) == 1 then
    written = written + 1
    if ARGV[i + 2] == '1' then failed = failed + 1 else completed = completed + 1 end
    tokens = tokens + tonumber(ARGV[i + 3])
  end
end
if written > 0 then
  redis.call('HINCRBY', KEYS[1], 'completed', completed)
  redis.call('HINCRBY', KEYS[1], 'failed', failed)
  redis.call('HINCRBY', KEYS[1], 'completion_tokens', tokens)
end
local h = redis.call('HMGET', KEYS[1], 'state', 'total', 'completed', 'failed')
if h[1] == 'in_progress' and tonumber(h[3]) + tonumber(h[4]) >= tonumber(h[2]) then
  redis.call('HSET', KEYS[1], 'state', 'completed', 'finished_at', ARGV[1])
end
return reply(written)
""",
    unless_gone=True,
)

# ARGV: group id, now. Result: 1 the first time a group finishes.
FINISH_GROUP = _job_script(
    """
local first = redis.call('SADD', KEYS[6], ARGV[1])
if first == 1 then redis.call('HINCRBY', KEYS[1], 'groups_done', 1) end
redis.call('SREM', KEYS[5], ARGV[1])
if redis.call('HGET', KEYS[1], 'state') == 'cancelling' and redis.call('SCARD', KEYS[5]) == 0 then
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished_at', ARGV[2])
end
return reply(first)
""",
    unless_gone=True,
)

# ARGV: group id. A worker holds the group now (taken before it reads the job's state).
MARK_LEASED = _job_script(
    """
redis.call('SADD', KEYS[5], ARGV[1])
return reply(1)
""",
    unless_gone=True,
)

# ARGV: now. Result: the state after the call.
CANCEL = _job_script(
    """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'validating' or state == 'in_progress' then
  state = 'cancelling'
  redis.call('HSET', KEYS[1], 'state', state)
end
if state == 'cancelling' and redis.call('SCARD', KEYS[5]) == 0 then
  state = 'cancelled'
  redis.call('HSET', KEYS[1], 'state', state, 'finished_at', ARGV[1])
end
return reply(state)
"""
)

# ARGV: error code, message, now.
FAIL = _job_script(
    """
redis.call('HSET', KEYS[1], 'state', 'failed', 'error_code', ARGV[1], 'error_message', ARGV[2],
           'finished_at', ARGV[3])
return reply('failed')
"""
)

# FAIL that Redis runs even when out of memory: a failed upload's job is marked failed rather than
# left validating for good (a few fields more). Script flags need Redis 7.
FAIL_WHEN_FULL = "#!lua flags=allow-oom\n" + FAIL

# ARGV: now, the plan (JSON), the prompt tokens grouping saves. Ends a validating dry run as
# completed with its plan; its request records go, as nothing will run them. Result: the state.
END_DRY_RUN = _job_script(
    """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'validating' then return reply(state) end
redis.call('HSET', KEYS[1], 'state', 'completed', 'plan', ARGV[2], 'prefix_tokens_saved', ARGV[3],
           'in_progress_at', ARGV[1], 'finished_at', ARGV[1])
redis.call('DEL', KEYS[2])
return reply('completed')
"""
)

# ARGV: now. Moves a validating job to in_progress, or straight to completed when every
# request is already answered (all invalid). Result: the state after the call.
START = _job_script(
    """
local h = redis.call('HMGET', KEYS[1], 'state', 'total', 'completed', 'failed')
if h[1] ~= 'validating' then return reply(h[1]) end
local state = 'in_progress'
if tonumber(h[3]) + tonumber(h[4]) >= tonumber(h[2]) then state = 'completed' end
redis.call('HSET', KEYS[1], 'state', state, 'in_progress_at', ARGV[1])
if state == 'completed' then redis.call('HSET', KEYS[1], 'finished_at', ARGV[1]) end
return reply(state)
"""
)

# KEYS: the job hash, its leased set, its done set; ARGV: a model; read only. All are read in one
# call so a group moving between leased and done is never seen in both or neither. Returns {state,
# groups_total, groups_done, leased} (the state is '' when the job is gone) over the model's own run
# of group ids when the job's `model_groups` gives the model only part of them (a job of several
# models), over the whole job otherwise.
MODEL_DEPTH = """
local h = redis.call('HMGET', KEYS[1], 'state', 'groups_total', 'groups_done', 'model_groups')
local ranges = h[4] and cjson.decode(h[4]) or {}
local r = ranges[ARGV[1]]
if not r or r[2] - r[1] == tonumber(h[2] or '0') then
  return {h[1] or '', h[2] or '0', h[3] or '0', redis.call('SCARD', KEYS[2])}
end
local function within(set)
  local n = 0
  for _, g in ipairs(redis.call('SMEMBERS', set)) do
    local i = tonumber(g)
    if i and i >= r[1] and i < r[2] then n = n + 1 end
  end
  return n
end
return {h[1] or '', tostring(r[2] - r[1]), tostring(within(KEYS[3])), within(KEYS[2])}
"""
