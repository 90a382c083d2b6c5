"""A job's live ETA: its plan's prediction corrected by the rate it is measured to run at.

Until a request finishes, the ETA is what the plan predicts (its wall time on the kind planned
for), less the time the job has run. Once a share f of its requests has finished in `elapsed`
seconds, the plan's remaining work, P x (1 - f), runs at the measured pace, elapsed / (P x f)
seconds per predicted second: elapsed x (1 - f) / f, which no longer needs the plan (a job
without one has an ETA from its first finished request on)."""

from __future__ import annotations

import json

from prefixgrove.jobs.redis_store.schema import JobRecord, JobState

UNKNOWN = -1.0


def eta_seconds(job: JobRecord, now: float) -> float:
    """Seconds until `job` ends (UNKNOWN when it cannot be told, 0 once ended)."""
    if job.state.terminal:
        return 0.0
    if job.state != JobState.IN_PROGRESS or not job.in_progress_at or not job.total:
        return UNKNOWN
    elapsed = max(now - job.in_progress_at, 0.0)
    done = (job.completed + job.failed) / job.total
    if done > 0:
        return elapsed * (1 - done) / done
    predicted = planned_wall_s(job)
    return UNKNOWN if predicted is None else max(predicted - elapsed, 0.0)


def planned_wall_s(job: JobRecord) -> float | None:
    """The wall time the job's plan predicts on the kind it was planned for, if it has one."""
    if not job.plan:
        return None
    devices = json.loads(job.plan)["devices"]
    first = next(iter(devices.values()), None)
    return float(first["wall_s"]) if isinstance(first, dict) else None
