"""kopf handlers: a BatchJob's lifecycle in the planner, and the worker autoscaler.

Run with `kopf run -m prefixgrove_operator.handlers --all-namespaces` (or `--namespace NS`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import time
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from prefixgrove.planner.client import PlannerClient, PlannerRejected, PlannerUnavailable
from prefixgrove_operator.autoscaler import pool_autoscalers
from prefixgrove_operator.credentials import secret_credentials
from prefixgrove_operator.finishing import (
    append_results,
    warn_of_failed_requests,
    why,
    write_results,
    wrote_message,
)
from prefixgrove_operator.settings import GROUP, PLURAL, VERSION, OperatorSettings
from prefixgrove_operator.spec import BatchJobSpec, InvalidSpec
from prefixgrove_operator.status import (
    TERMINAL_PHASES,
    JobView,
    failed_status,
    job_status,
    job_view,
    with_condition,
)
from prefixgrove_operator.verdicts import (
    FAILURE_TARGET,
    Verdict,
    failure_target,
    stop_verdict,
    unserved_message,
    unserved_warning_s,
)
from prefixgrove_proto import planner_pb2 as pb

# NOTE: read at import because kopf takes timer intervals when the decorators run.
SETTINGS = OperatorSettings.from_env()
BATCHJOBS = (GROUP, VERSION, PLURAL)


def _load_kube_config() -> None:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        # NOTE: the kubernetes package reads KUBECONFIG once, when first imported; read it now.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # NOTE: kopf's own readers, not the kubernetes package's: that one reads KUBECONFIG only once,
    # when first imported.
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/cancel-job"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # lifecycle Events are posted explicitly (kopf.event); kopf's own only for warnings and errors
    settings.posting.level = logging.WARNING
    # a watch the API server ends now and then is re-opened; one that silently hangs never would be
    settings.watching.server_timeout = 600
    settings.watching.client_timeout = 660
    _load_kube_config()
    memo.planner = PlannerClient(
        SETTINGS.planner_address, SETTINGS.planner_security, timeout_s=SETTINGS.rpc_timeout_s
    )
    memo.core = client.CoreV1Api()
    memo.custom = client.CustomObjectsApi()
    memo.autoscaler_stop = asyncio.Event()
    # one per worker pool, each fed by its own model's queue (every model's for the single
    # Deployment of PREFIXGROVE_WORKER_DEPLOYMENT with no PREFIXGROVE_WORKER_MODEL)
    autoscalers = pool_autoscalers(
        SETTINGS, lambda model: memo.planner.queue_depth(model).depth, client.AppsV1Api()
    )
    # NOTE: loops, not a kopf.timer on the Deployments: timers put a finalizer on their object,
    # and a Helm-owned Deployment must stay deletable when the operator is gone.
    memo.autoscaler_tasks = [asyncio.create_task(a.run(memo.autoscaler_stop)) for a in autoscalers]


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    memo.autoscaler_stop.set()
    await asyncio.gather(*memo.autoscaler_tasks)
    memo.planner.close()


@kopf.on.create(*BATCHJOBS)
def submit(
    spec: kopf.Spec,
    uid: str,
    name: str,
    namespace: str | None,
    status: kopf.Status,
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: Any,
    **_: Any,
) -> None:
    """Sends the BatchJob to the planner once: the uid is the idempotency key, so a retry or an
    operator restart finds the job it already created."""
    conditions = status.get("conditions")
    namespace = namespace or "default"  # BatchJobs are namespaced; kopf's types allow None
    patch.status["observedGeneration"] = body.metadata.get("generation")
    try:
        job_spec = BatchJobSpec.parse(spec, SETTINGS.shared_volume_root)
        job = _create_job(job_spec, memo, uid, namespace, name, logger)
    except InvalidSpec as exc:
        _fail(patch, body, exc.reason, str(exc), conditions)
        return
    except PlannerRejected as exc:
        _fail(patch, body, "PlannerRejected", str(exc), conditions)
        return
    except PlannerUnavailable as exc:
        patch.status.update({"phase": "Pending", "message": f"waiting for the planner: {exc}"})
        raise kopf.TemporaryError(str(exc), delay=SETTINGS.retry_delay_s) from None
    # a job already final (every line refused) is Finalizing: the status timer writes its results
    new = job_status(job, conditions)
    new["message"] = None  # clears "waiting for the planner"
    new["conditions"] = with_condition(
        new.get("conditions", conditions), "Submitted", True, "Submitted", f"planner job {job.id}"
    )
    patch.status.update(new)
    # an input.url job is still being read by the planner: its count is not known yet
    counted = f"{job.total} requests" if job.sealed else "the planner reads its input"
    kopf.event(body, type="Normal", reason="Submitted", message=f"planner job {job.id}, {counted}")
    _announce(body, job, new)


def _create_job(
    job_spec: BatchJobSpec, memo: kopf.Memo, uid: str, namespace: str, name: str, logger: Any
) -> JobView:
    """The BatchJob's planner job: an `input.url` is handed to the planner, which reads it (with
    the Secret's credentials) and seals the job; any other input is streamed from here."""
    labels = {"namespace": namespace, "name": name}
    dry_run = pb.PlanOptions() if job_spec.dry_run else None  # the planner's default kind
    if job_spec.input_url is not None:
        credentials = secret_credentials(memo.core, namespace, job_spec.credentials_secret)
        source = job_spec.source(credentials)
        return job_view(memo.planner.create_job(job_spec.model, uid, labels, source=source,
                                                dry_run=dry_run))  # fmt: skip
    lines = job_spec.request_lines(memo.core, namespace)
    job = job_view(memo.planner.create_job(job_spec.model, uid, labels, dry_run=dry_run))
    if not job.sealed:
        _show_validating(memo, namespace, name, job.id, logger)
        # lines a broken earlier attempt already delivered are skipped, not sent twice
        memo.planner.add_lines(job.id, lines, skip=job.total)
        job = job_view(memo.planner.seal(job.id))
    return job


def _show_validating(memo: kopf.Memo, namespace: str, name: str, job_id: str, logger: Any) -> None:
    """Status phase Validating while the requests upload. NOTE: written at once, not through
    kopf's patch, which reaches the API server only when the handler returns."""
    message = f"uploading the requests to planner job {job_id}"
    try:
        memo.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name,
            {"status": {"phase": "Validating", "message": message}},
        )  # fmt: skip
    except ApiException as exc:  # the upload goes on; the phase shows once it ends
        logger.warning("status.phase Validating not written: %s", exc.reason)


def _tracking(status: kopf.Status, **_: Any) -> bool:
    return bool(status.get("jobId")) and status.get("phase") not in TERMINAL_PHASES


@kopf.timer(*BATCHJOBS, interval=SETTINGS.status_interval_s, when=_tracking)
def sync(
    spec: kopf.Spec,
    status: kopf.Status,
    body: kopf.Body,
    patch: kopf.Patch,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Keeps status in step with the planner, appends the results answered since the last round to
    the output files, and stops a job that was cancelled, is unserved or failed too often. The
    BatchJob ends only once its planner job is final and the last results are written."""
    conditions = status.get("conditions")
    try:
        job_spec = BatchJobSpec.parse(spec, SETTINGS.shared_volume_root)
    except InvalidSpec as exc:  # e.g. the output folder became a link out of the volume
        _fail(patch, body, exc.reason, str(exc), conditions)
        return
    try:
        job, queued_s, target = _steer(job_spec, status, body, memo.planner)
    except PlannerUnavailable as exc:
        raise kopf.TemporaryError(str(exc), delay=SETTINGS.retry_delay_s) from None
    except PlannerRejected as exc:
        message = f"the planner no longer knows job {status['jobId']}: {exc}"
        _fail(patch, body, "JobLost", message, conditions)
        return
    new = job_status(job, conditions, status.get("firstFailure", ""))
    new["observedGeneration"] = body.metadata.get("generation")
    conditions = new.get("conditions", conditions)
    if target is not None:
        new["message"] = f"stopping: {target.message}"
        new["conditions"] = with_condition(
            conditions, FAILURE_TARGET, True, target.reason, target.message
        )
    else:
        new["conditions"] = _served_condition(job, job_spec, body, conditions, queued_s)
    new.update(write_results(job, job_spec, body, memo.planner, memo.core, new, target))
    warn_of_failed_requests(body, status, new)
    if new["phase"] != status.get("phase"):
        _announce(body, job, new)
    patch.status.update(new)


def _steer(
    job_spec: BatchJobSpec, status: kopf.Status, body: kopf.Body, planner: PlannerClient
) -> tuple[JobView, float, Verdict | None]:
    """The planner job after what the spec or a stop verdict asks of it (a cancel), how long it
    has been queued unserved, and the verdict that stops it (reached now or in an earlier round)."""
    job = job_view(planner.get(status["jobId"]))
    if job_spec.cancel and job.phase not in (*TERMINAL_PHASES, "Cancelling"):
        job = job_view(planner.cancel(job.id))
        kopf.event(body, type="Normal", reason="Cancelling", message="spec.cancel is true")
    queued_s = _unserved_s(job, job_spec, planner)
    target = failure_target(status.get("conditions"))
    if target is None and job.phase in ("Queued", "Running", "Succeeded"):
        target = stop_verdict(job, job_spec, SETTINGS, queued_s)
        if target is not None:
            kopf.warn(body, reason=target.reason, message=target.message)
            if not job.terminal:
                job = job_view(planner.cancel(job.id))
    return job, queued_s, target


def _unserved_s(job: JobView, job_spec: BatchJobSpec, planner: PlannerClient) -> float:
    """How long `job` has been Queued while no worker works on its model; 0 while one does (it
    is busy with other jobs: this one waits its turn)."""
    if job.phase != "Queued" or not job.started_at:
        return 0.0
    if planner.queue_depth(job_spec.model).groups_leased:
        return 0.0
    return time.time() - job.started_at


def _served_condition(
    job: JobView, job_spec: BatchJobSpec, body: kopf.Body, conditions: Any, queued_s: float
) -> Any:
    """The Unserved condition: True (with a Warning) once a job has waited for a worker too long,
    False again once one serves it."""
    unserved = any(
        c.get("type") == "Unserved" and c.get("status") == "True" for c in conditions or ()
    )
    if job.phase == "Queued" and queued_s >= unserved_warning_s(job_spec, SETTINGS):
        message = unserved_message(job_spec, SETTINGS, queued_s)
        if not unserved:
            kopf.warn(body, reason="Unserved", message=message)
        return with_condition(conditions, "Unserved", True, "NoWorkerServing", message)
    if unserved and (job.phase != "Queued" or not queued_s):
        return with_condition(conditions, "Unserved", False, "Served", "a worker serves the job")
    return conditions


def _fail(patch: kopf.Patch, body: kopf.Body, reason: str, message: str, conditions: Any) -> None:
    patch.status.update(failed_status(reason, message, conditions))
    patch.status["observedGeneration"] = body.metadata.get("generation")
    kopf.warn(body, reason=reason, message=message)


def _announce(body: kopf.Body, job: JobView, new: dict[str, Any]) -> None:
    phase = new["phase"]
    message = new.get("message") or f"{new['progress']} of {job.total} requests"
    if phase == "Failed":
        kopf.warn(body, reason=phase, message=message)
    else:
        kopf.event(body, type="Normal", reason=phase, message=message)


@kopf.on.update(*BATCHJOBS, field="spec")
def refuse_spec_change(
    body: kopf.Body, status: kopf.Status, patch: kopf.Patch, old: Any, new: Any, **_: Any
) -> None:
    """Warns of spec changes after submission; spec.cancel is the one change the operator acts on
    (the status timer reads it). Either way the change is seen: observedGeneration follows it."""
    patch.status["observedGeneration"] = body.metadata.get("generation")
    changed = {
        key for key in {*(old or {}), *(new or {})} if (old or {}).get(key) != (new or {}).get(key)
    }
    if status.get("jobId") and changed - {"cancel"}:
        kopf.warn(
            body,
            reason="SpecImmutable",
            message="spec changes after submission are ignored; delete and re-create the BatchJob",
        )


@kopf.on.delete(*BATCHJOBS, timeout=SETTINGS.cancel_timeout_s)
async def cancel(
    spec: kopf.Spec,
    uid: str,
    status: kopf.Status,
    body: kopf.Body,
    memo: kopf.Memo,
    logger: Any,
    **_: Any,
) -> None:
    """Cancels the planner job of a BatchJob deleted before it ended, follows it until it is final,
    then writes its last results: every answered line, and the requests never run as errors. A
    job not final PREFIXGROVE_CANCEL_TIMEOUT_S after the deletion is let go as it stands.
    NOTE: async, so a job that drains for minutes holds no thread while it waits."""
    if status.get("phase") in TERMINAL_PHASES:
        return
    planner = memo.planner
    try:
        job = await asyncio.to_thread(_cancel_job, planner, status.get("jobId"), uid)
        while job is not None and not job.terminal and _time_left(body) > 0:
            await asyncio.sleep(min(SETTINGS.status_interval_s, _time_left(body)))
            job = job_view(await asyncio.to_thread(planner.get, job.id))
        if job is None or not job.terminal:
            if job is not None:
                logger.warning(
                    "planner job %s is still %s: its files are left as they are", job.id, job.phase
                )
            return
        job_spec = BatchJobSpec.parse(spec, SETTINGS.shared_volume_root)
        namespace = body.metadata.namespace or "default"
        written, _failure = await asyncio.to_thread(
            append_results, planner, memo.core, namespace, job.id, job_spec, True
        )
    except (PlannerUnavailable, OSError) as exc:
        raise kopf.TemporaryError(why(exc), delay=SETTINGS.retry_delay_s) from None
    except (PlannerRejected, InvalidSpec) as exc:
        logger.warning("the results of the deleted BatchJob are not written: %s", exc)
        return
    shown = job_spec.output_name
    logger.info(
        "planner job %s is %s; %s", job.id, job.phase, wrote_message(job, job_spec, shown, written)
    )


def _cancel_job(planner: PlannerClient, job_id: str | None, uid: str) -> JobView | None:
    """The BatchJob's planner job, cancelled unless it has ended; None when there is none."""
    # deleted while its submission was under way: the job may exist without status.jobId yet
    found = job_id or _find_job_id(planner, uid)
    if found is None:
        return None
    job = job_view(planner.get(found))
    if job.phase not in (*TERMINAL_PHASES, "Cancelling"):
        job = job_view(planner.cancel(found))
    return job


def _time_left(body: kopf.Body) -> float:
    """Seconds left of PREFIXGROVE_CANCEL_TIMEOUT_S since the BatchJob was deleted."""
    deleted = body.metadata.deletion_timestamp
    since = dt.datetime.fromisoformat(deleted.replace("Z", "+00:00")) if deleted else None
    start = since.timestamp() if since else time.time()
    return start + SETTINGS.cancel_timeout_s - time.time()


def _find_job_id(planner: PlannerClient, uid: str) -> str | None:
    job = planner.find_job(uid)
    return job.id if job else None
