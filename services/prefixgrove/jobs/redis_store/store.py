"""Job state in Redis, as the planner and the workers read and write it (records in schema.py)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.commands.core import Script

from prefixgrove.jobs.ingest import IngestedBatch, JobPlan
from prefixgrove.jobs.output_lines import run_tag
from prefixgrove.jobs.redis_store import schema
from prefixgrove.jobs.redis_store.alone_note import AloneNote, alone_field
from prefixgrove.jobs.redis_store.connection import Redis
from prefixgrove.jobs.redis_store.idempotency import IdempotencyKeys
from prefixgrove.jobs.redis_store.schema import (
    GroupRecord,
    JobKeys,
    JobRecord,
    JobState,
    ResultRecord,
    text,
)
from prefixgrove.jobs.request_errors import RequestError

_BATCH = 1000


@dataclass(frozen=True)
class QueueDepth:
    waiting: int
    leased: int

    @property
    def depth(self) -> int:
        return self.waiting + self.leased


class JobStore:
    """Works the same on one Redis, a Sentinel-managed one and a Redis Cluster (see connection.py):
    the keys of one job share a slot, and every script is handed each key it touches."""

    def __init__(self, client: Redis, retention_s: int = 0) -> None:
        """`retention_s`: how long the keys of a job created here stay once it finished (0: ever)."""
        self.r = client
        self.retention_s = retention_s
        self._write_results = client.register_script(schema.WRITE_RESULTS)
        self._finish_group = client.register_script(schema.FINISH_GROUP)
        self._mark_leased = client.register_script(schema.MARK_LEASED)
        self._cancel = client.register_script(schema.CANCEL)
        self._fail = client.register_script(schema.FAIL)
        self._fail_when_full = client.register_script(schema.FAIL_WHEN_FULL)
        self._start = client.register_script(schema.START)
        self.keys = IdempotencyKeys(client)

    # --- jobs -------------------------------------------------------------------------------
    def create_job(self, model: str, idempotency_key: str = "",
                   metadata: dict[str, str] | None = None, input_lines: int = 0,
                   input_digest: str = "") -> tuple[JobRecord, bool]:  # fmt: skip
        """Returns (job, created); a key used before gives back its job while that job lasts
        (idempotency.check_same_input tells whether it was made for the same input)."""
        job = self.new_job(model, idempotency_key, metadata, input_lines, input_digest)
        existing = self.claim_key(job)
        if existing is not None:
            self.drop_job(job.id)
            return existing, False
        self.list_job(job)
        return job, True

    def new_job(self, model: str, idempotency_key: str = "", metadata: dict[str, str] | None = None,
                input_lines: int = 0, input_digest: str = "") -> JobRecord:  # fmt: skip
        """Writes a new job's record; neither its key (claim_key) nor the list (list_job) has it."""
        job = JobRecord(id=f"job_{uuid.uuid4().hex[:20]}", model=model, idempotency_key=idempotency_key,
                        created_at=time.time(), metadata=dict(metadata or {}),
                        retention_s=self.retention_s, input_lines=input_lines,
                        input_digest=input_digest)  # fmt: skip
        self.r.hset(JobKeys(job.id).job, mapping=job.encode())  # type: ignore[arg-type]
        return job

    def claim_key(self, job: JobRecord) -> JobRecord | None:
        """Makes the job's key name it, unless it names a job still there: returns that one."""
        if not job.idempotency_key:
            return None
        return self.keys.claim(job.idempotency_key, job.id, self.get_job)

    def list_job(self, job: JobRecord) -> None:
        self.r.zadd(schema.JOBS, {job.id: job.created_at})

    def drop_job(self, job_id: str) -> None:
        """Deletes a job no list holds and no key names (claim_key said no)."""
        self.r.delete(*JobKeys(job_id).all())

    def _run(self, script: Script, job_id: str, args: Sequence[Any]) -> Any:
        """Runs a job script (schema.py) and returns its result; when the call made the job's keys
        expire, the job's idempotency key, in a slot of its own, gets the same retention."""
        result, idempotency_key, retention_s = script(keys=JobKeys(job_id).all(), args=args)
        if idempotency_key:
            self.keys.expire(text(idempotency_key), job_id, int(retention_s))
        return result

    def get_job(self, job_id: str) -> JobRecord | None:
        """The job, or None when its record is gone (expired, or Redis lost its data; a record
        without its id is the remains of one, not a job)."""
        raw = self.r.hgetall(JobKeys(job_id).job)
        if not raw or (b"id" not in raw and "id" not in raw):  # type: ignore[operator]
            return None
        return JobRecord.decode(raw)  # type: ignore[arg-type]

    def job_state(self, job_id: str) -> JobState | None:
        raw = self.r.hget(JobKeys(job_id).job, "state")
        return JobState(raw.decode()) if raw else None  # type: ignore[union-attr]

    def list_jobs(self, limit: int, start: int = 0) -> tuple[list[JobRecord], bool]:
        """Up to `limit` jobs, newest first, from position `start`; and whether more follow."""
        raw = self.r.zrevrange(schema.JOBS, start, start + limit)  # one more: is there a next page?
        ids = [text(i) for i in raw[:limit]]  # type: ignore[index,arg-type]
        jobs = [self.get_job(i) for i in ids]
        expired = [i for i, j in zip(ids, jobs, strict=True) if j is None]
        if expired:
            self.r.zrem(schema.JOBS, *expired)
        return [j for j in jobs if j is not None], len(raw) > limit  # type: ignore[arg-type]

    # --- planners -------------------------------------------------------------------------
    def heartbeat(self, instance: str, ttl_s: int) -> None:
        """A planner's: uploads.py tells by it whether the planner streaming a job in is alive.
        Renewed by EXPIRE, which a Redis out of memory still takes: a live planner stays alive."""
        key = schema.planner_key(instance)
        if not self.r.expire(key, ttl_s):
            self.r.set(key, 1, ex=ttl_s)

    def fail_job(self, job_id: str, code: str, message: str) -> None:
        self._run(self._fail, job_id, [code, message, time.time()])

    def abandon_upload(self, job_id: str, message: str) -> None:
        """Fails a job whose client stopped streaming its input, and drops the lines it sent."""
        self.fail_ingest(job_id, "upload_abandoned", message)
        self.r.delete(JobKeys(job_id).requests)

    def fail_ingest(self, job_id: str, code: str, message: str, when_full: bool = False) -> None:
        """Fails a job whose input never made it in (interrupted, empty, not JSONL; `when_full`:
        Redis out of memory). Its idempotency key is freed even when the failing is refused."""
        try:
            script = self._fail_when_full if when_full else self._fail
            self._run(script, job_id, [code, message, time.time()])
        finally:
            job = self.get_job(job_id)
            if job is not None and job.idempotency_key:
                self.keys.release(job.idempotency_key, job_id)

    def fail_ingest_out_of_memory(self, job_id: str, message: str) -> None:
        """Fails a job whose upload Redis refused for lack of memory, its lines deleted first (Redis
        takes deletes when full); a Redis before 7 (no script flags) has it deleted whole."""
        keys = JobKeys(job_id)
        self.r.delete(keys.requests, keys.results)
        try:
            self.fail_ingest(job_id, "redis_out_of_memory", message, when_full=True)
        except redis.ResponseError:
            self.r.delete(*keys.all())
            self.r.zrem(schema.JOBS, job_id)

    def cancel(self, job_id: str) -> JobState:
        return JobState(text(self._run(self._cancel, job_id, [time.time()])))

    # --- ingest -----------------------------------------------------------------------------
    def write_requests(
        self, job_id: str, batch: IngestedBatch, total: int, prompt_tokens: int
    ) -> None:
        keys = JobKeys(job_id)
        for start in range(0, len(batch.requests), _BATCH):
            records = {
                str(request.index): schema.RequestRecord(
                    request.custom_id, request.endpoint, request.params, tokens, request.model
                ).encode()
                for request, tokens in batch.requests[start : start + _BATCH]
            }
            self.r.hset(keys.requests, mapping=records)  # type: ignore[arg-type]
        self.write_errors(job_id, batch.errors)
        self.r.hset(keys.job, mapping={"total": total, "prompt_tokens": prompt_tokens})

    def write_errors(self, job_id: str, errors: Sequence[RequestError]) -> int:
        results = [(e.index, ResultRecord(True, e.to_line(run_tag(job_id))), 0) for e in errors]
        return self.write_results(job_id, results)

    def queue_plan(self, job_id: str, model: str, plan: JobPlan) -> JobState:
        """Writes the groups of a job of one model, queues them, and starts the job."""
        return self.queue_plans(job_id, {model: plan})

    def queue_plans(self, job_id: str, plans: Mapping[str, JobPlan]) -> JobState:
        """Writes the groups of every model of a job, queues each on its model's queue, and
        starts the job. Each model's groups take one run of group ids, kept in the job hash's
        `model_groups` ({model: [first, end)}), so a model's queue depth counts only its own."""
        keys = JobKeys(job_id)
        ranges, first = {}, 0
        for model, plan in plans.items():
            ranges[model] = [first, first + len(plan.units)]
            first += len(plan.units)
        self.r.hset(keys.job, mapping={
            "groups_total": first, "model_groups": json.dumps(ranges),
            "prefix_tokens_saved": sum(p.prefix_tokens_saved for p in plans.values()),
        })  # fmt: skip
        for model, plan in plans.items():
            self._queue_units(job_id, model, plan, ranges[model][0])
        return JobState(text(self._run(self._start, job_id, [time.time()])))

    def _queue_units(self, job_id: str, model: str, plan: JobPlan, first: int) -> None:
        """Each unit's record and stream entry: {job, group, prefix (affinity.py) if it has one}."""
        units, prefixes = plan.units, plan.affinity_keys or [""] * len(plan.units)
        self.ensure_queue(model)
        self.r.sadd(schema.active_key(model), job_id)
        for start in range(0, len(units), _BATCH):
            chunk = units[start : start + _BATCH]
            gids = range(first + start, first + start + len(chunk))
            pipe = self.r.pipeline(transaction=False)
            pipe.hset(JobKeys(job_id).groups,
                      mapping={str(g): u.encode() for g, u in zip(gids, chunk, strict=True)})  # fmt: skip
            for gid, prefix in zip(gids, prefixes[start : start + len(chunk)], strict=True):
                entry = {"job": job_id, "group": str(gid)} | ({"prefix": prefix} if prefix else {})
                pipe.xadd(schema.queue_key(model), entry)  # type: ignore[arg-type]
            pipe.execute()

    def ensure_queue(self, model: str) -> None:
        self.r.sadd(schema.MODELS, model)
        try:
            self.r.xgroup_create(
                schema.queue_key(model), schema.CONSUMER_GROUP, id="0", mkstream=True
            )
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # --- work -------------------------------------------------------------------------------
    def load_group(
        self, job_id: str, group_id: str
    ) -> tuple[GroupRecord, list[schema.RequestRecord]] | None:
        keys = JobKeys(job_id)
        raw = self.r.hget(keys.groups, group_id)
        if raw is None:
            return None
        group = GroupRecord.decode(raw)  # type: ignore[arg-type]
        blobs = self.r.hmget(keys.requests, [str(i) for i in group.indices])
        return group, [schema.RequestRecord.decode(b) for b in blobs]  # type: ignore[arg-type]

    def write_results(self, job_id: str, results: Sequence[tuple[int, ResultRecord, int]]) -> int:
        """(line index, result, completion tokens) each; first write wins. Returns how many were new."""
        written = 0
        for start in range(0, len(results), _BATCH):
            args: list[Any] = [time.time()]
            for index, result, tokens in results[start : start + _BATCH]:
                args += [index, result.encode(), int(result.is_error), tokens]
            written += int(self._run(self._write_results, job_id, args))
        return written

    def mark_leased(self, job_id: str, group_id: str) -> None:
        self._run(self._mark_leased, job_id, [group_id])

    def finish_group(self, job_id: str, group_id: str) -> bool:
        return bool(self._run(self._finish_group, job_id, [group_id, time.time()]))

    def mark_alone(self, job_id: str, group_id: str, note: AloneNote) -> None:
        """Notes the request a worker now runs alone (alone_note.py)."""
        self.r.hset(JobKeys(job_id).groups, alone_field(group_id), note.encode())

    def ran_alone(self, job_id: str, group_id: str) -> AloneNote | None:
        """The note of the request of the group a worker last ran alone."""
        raw = self.r.hget(JobKeys(job_id).groups, alone_field(group_id))
        return None if raw is None else AloneNote.decode(raw)  # type: ignore[arg-type]

    def is_group_done(self, job_id: str, group_id: str) -> bool:
        return bool(self.r.sismember(JobKeys(job_id).done, group_id))

    def read_answered(self, job_id: str, indices: Sequence[int]) -> set[int]:
        """Which of these requests already have a result (a group taken over half done)."""
        pipe = self.r.pipeline(transaction=False)
        for index in indices:
            pipe.hexists(JobKeys(job_id).results, str(index))
        return {i for i, present in zip(indices, pipe.execute(), strict=True) if present}

    # --- reading back -----------------------------------------------------------------------
    def read_results(self, job_id: str, start: int, count: int) -> list[ResultRecord | None]:
        fields = [str(i) for i in range(start, start + count)]
        blobs = self.r.hmget(JobKeys(job_id).results, fields)
        return [None if b is None else ResultRecord.decode(b) for b in blobs]  # type: ignore[union-attr,arg-type]

    def read_custom_ids(self, job_id: str, indices: Sequence[int]) -> list[str | None]:
        """The custom_id of each request at `indices`; None where the job holds no such request."""
        if not indices:
            return []
        blobs: list[bytes | None] = self.r.hmget(  # type: ignore[assignment]
            JobKeys(job_id).requests, [str(i) for i in indices]
        )
        return [None if b is None else schema.RequestRecord.decode(b).custom_id for b in blobs]

    def job_queue(self, job: JobRecord) -> QueueDepth:
        if job.state.terminal or job.groups_total == 0:
            return QueueDepth(0, 0)
        leased = int(self.r.scard(JobKeys(job.id).leased))  # type: ignore[arg-type]
        return _depth(job.groups_total, job.groups_done, leased)

    def index_active_jobs(self) -> int:
        """Puts every queued job that may still run into its model's active set (jobs queued
        before the set existed); returns how many are there."""
        ids = [text(i) for i in self.r.zrange(schema.JOBS, 0, -1)]  # type: ignore[union-attr,arg-type]
        found = 0
        for start in range(0, len(ids), _BATCH):
            chunk = ids[start : start + _BATCH]
            pipe = self.r.pipeline(transaction=False)
            for job_id in chunk:
                pipe.hmget(JobKeys(job_id).job, ["state", "model", "groups_total", "model_groups"])
            for job_id, (state, model, groups, ranges) in zip(chunk, pipe.execute(), strict=True):
                if state is not None and JobState(text(state)).runnable and int(groups or 0) > 0:
                    for name in json.loads(ranges) if ranges else [text(model)]:
                        self.r.sadd(schema.active_key(name), job_id)
                    found += 1
        return found

    def trim_queues(self) -> int:
        """Drops stream entries every worker is done with: older than the oldest one leased and
        than the last one delivered. Returns how many went."""
        removed = 0
        for model in sorted(text(m) for m in self.r.smembers(schema.MODELS)):  # type: ignore[union-attr]
            key = schema.queue_key(model)
            try:
                groups = {text(g["name"]): g for g in self.r.xinfo_groups(key)}
                pending: Any = self.r.xpending(key, schema.CONSUMER_GROUP)
            except redis.ResponseError:
                continue
            if schema.CONSUMER_GROUP not in groups:
                continue
            keep_from = text(groups[schema.CONSUMER_GROUP]["last-delivered-id"])
            if pending and pending.get("pending"):
                keep_from = min(keep_from, text(pending["min"]), key=_entry_id)
            removed += int(self.r.xtrim(key, minid=keep_from, approximate=False))  # type: ignore[arg-type]
        return removed

    def model_queue(self, model: str | None = None) -> QueueDepth:
        """Groups still to run over every job of a model that will run them: waiting + leased.

        Counted from each queued job's own counters, each job's read in one call (MODEL_DEPTH) so
        it is consistent (in a job of several models, over the model's own run of group ids): groups_total - groups_done (FINISH_GROUP moves it once per group) split by the
        job's leased set (added before a worker runs a group, removed when it is finished or given
        back; a group taken over stays in it). A cancelling, cancelled, failed or completed job
        counts nothing, whatever its stream entries still say; terminal jobs leave the model's
        active set here."""
        models = [model] if model else sorted(text(m) for m in self.r.smembers(schema.MODELS))  # type: ignore[union-attr]
        total = QueueDepth(0, 0)
        for name in models:
            active = schema.active_key(name)
            ids = sorted(text(i) for i in self.r.smembers(active))  # type: ignore[union-attr]
            if not ids:
                continue
            pipe = self.r.pipeline(transaction=False)
            for job_id in ids:
                keys = JobKeys(job_id)
                # EVAL, not a registered script: a cluster pipeline cannot load one on its nodes
                # (nor take .eval(), so the command goes in as it is)
                pipe.execute_command(
                    "EVAL", schema.MODEL_DEPTH, 3, keys.job, keys.leased, keys.done, name
                )
            finished = []
            for job_id, (state, groups, done, leased) in zip(ids, pipe.execute(), strict=True):
                if not state or JobState(text(state)).terminal:
                    finished.append(job_id)
                elif JobState(text(state)).runnable:
                    depth = _depth(int(groups or 0), int(done or 0), int(leased))
                    total = QueueDepth(total.waiting + depth.waiting, total.leased + depth.leased)
            if finished:
                self.r.srem(active, *finished)
        return total


def _depth(groups_total: int, groups_done: int, leased: int) -> QueueDepth:
    return QueueDepth(max(groups_total - groups_done - leased, 0), leased)


def _entry_id(entry: str) -> tuple[int, int]:
    ms, _, seq = entry.partition("-")
    return int(ms), int(seq or 0)
