"""kopf handlers: a BatchJob's lifecycle in the planner, and the worker autoscaler.

Run with `kopf run -m prefixgrove_operator.handlers --all-namespaces` (or `--namespace NS`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf
from kubernetes import client, config

from prefixgrove.planner.client import PlannerClient, PlannerRejected, PlannerUnavailable
from prefixgrove_operator.autoscaler import Autoscaler, WorkerScaler
from prefixgrove_operator.settings import GROUP, PLURAL, VERSION, OperatorSettings
from prefixgrove_operator.spec import BatchJobSpec, InvalidSpec, on_volume
from prefixgrove_operator.status import (
    TERMINAL_PHASES,
    JobView,
    failed_status,
    job_status,
    job_view,
    rfc3339,
    with_condition,
)

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
    memo.autoscaler_stop = asyncio.Event()
    memo.autoscaler_task = None
    if SETTINGS.autoscaling:
        autoscaler = Autoscaler(
            SETTINGS,
            queue_depth=lambda: memo.planner.queue_depth(SETTINGS.worker_model).depth,
            scaler=WorkerScaler(
                client.AppsV1Api(), SETTINGS.worker_deployment, SETTINGS.worker_namespace
            ),
        )
        # NOTE: a loop, not a kopf.timer on the Deployment: timers put a finalizer on their object,
        # and a Helm-owned Deployment must stay deletable when the operator is gone.
        memo.autoscaler_task = asyncio.create_task(autoscaler.run(memo.autoscaler_stop))


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    memo.autoscaler_stop.set()
    if memo.autoscaler_task is not None:
        await memo.autoscaler_task
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
    **_: Any,
) -> None:
    """Sends the BatchJob to the planner once: the uid is the idempotency key, so a retry or an
    operator restart finds the job it already created."""
    conditions = status.get("conditions")
    namespace = namespace or "default"  # BatchJobs are namespaced; kopf's types allow None
    try:
        job_spec = BatchJobSpec.parse(spec, SETTINGS.shared_volume_root)
        lines = job_spec.request_lines(memo.core, namespace)
        labels = {"namespace": namespace, "name": name}
        job = job_view(memo.planner.create_job(job_spec.model, uid, labels))
        if not job.sealed:
            # lines a broken earlier attempt already delivered are skipped, not sent twice
            memo.planner.add_lines(job.id, lines, skip=job.total)
            job = job_view(memo.planner.seal(job.id))
    except InvalidSpec as exc:
        patch.status.update(failed_status(exc.reason, str(exc), conditions))
        kopf.warn(body, reason=exc.reason, message=str(exc))
        return
    except PlannerRejected as exc:
        patch.status.update(failed_status("PlannerRejected", str(exc), conditions))
        kopf.warn(body, reason="PlannerRejected", message=str(exc))
        return
    except PlannerUnavailable as exc:
        patch.status.update({"phase": "Pending", "message": f"waiting for the planner: {exc}"})
        raise kopf.TemporaryError(str(exc), delay=SETTINGS.retry_delay_s) from None
    new = job_status(job, conditions)
    new.setdefault("message", None)  # clears "waiting for the planner"
    new["observedGeneration"] = body.metadata.get("generation")
    new["conditions"] = with_condition(
        new.get("conditions", conditions), "Submitted", True, "Submitted", f"planner job {job.id}"
    )
    patch.status.update(new)
    kopf.event(
        body,
        type="Normal",
        reason="Submitted",
        message=f"planner job {job.id}, {job.total} requests",
    )


def _tracking(status: kopf.Status, **_: Any) -> bool:
    return bool(status.get("jobId")) and status.get("phase") not in TERMINAL_PHASES


@kopf.timer(*BATCHJOBS, interval=SETTINGS.status_interval_s, when=_tracking)
def sync(
    status: kopf.Status, body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any
) -> None:
    """Keeps status in step with the planner; writes the results out when the job has finished."""
    conditions = status.get("conditions")
    try:
        job = job_view(memo.planner.get(status["jobId"]))
    except PlannerUnavailable as exc:
        raise kopf.TemporaryError(str(exc), delay=SETTINGS.retry_delay_s) from None
    except PlannerRejected as exc:
        message = f"the planner no longer knows job {status['jobId']}: {exc}"
        patch.status.update(failed_status("JobLost", message, conditions))
        kopf.warn(body, reason="JobLost", message=message)
        return
    new = job_status(job, conditions)
    if job.phase == "Succeeded":
        try:
            new.update(_write_results(job, body, memo, conditions))
        except InvalidSpec as exc:  # e.g. the output folder became a link out of the volume
            new.update(failed_status(exc.reason, str(exc), conditions))
    if new["phase"] != status.get("phase"):
        _announce(body, job, new)
    patch.status.update(new)


def _write_results(
    job: JobView, body: kopf.Body, memo: kopf.Memo, conditions: Any
) -> dict[str, Any]:
    job_spec = BatchJobSpec.parse(body.spec, SETTINGS.shared_volume_root)
    try:
        outputs, errors = memo.planner.write_results(
            job.id, job_spec.output_path, job_spec.errors_path
        )
    except PlannerUnavailable as exc:
        kopf.warn(body, reason="OutputNotWritten", message=f"retrying: {exc}")
        return {"phase": "Finalizing", "completionTime": None}
    except OSError as exc:  # its strerror, not its text: that names the operator's own paths
        where = on_volume(job_spec.volume_root, job_spec.output_path)
        kopf.warn(body, reason="OutputNotWritten", message=f"retrying {where}: {exc.strerror}")
        return {"phase": "Finalizing", "completionTime": None}
    message = (
        f"wrote {outputs} outputs to {on_volume(job_spec.volume_root, job_spec.output_path)} and "
        f"{errors} errors to {on_volume(job_spec.volume_root, job_spec.errors_path)}"
    )
    return {
        "message": message,
        "completionTime": rfc3339(job.finished_at or None),
        "conditions": with_condition(conditions, "Complete", True, "Succeeded", message),
    }


def _announce(body: kopf.Body, job: JobView, new: dict[str, Any]) -> None:
    phase = new["phase"]
    message = new.get("message") or f"{new['progress']} of {job.total} requests"
    if phase == "Failed":
        kopf.warn(body, reason=phase, message=message)
    else:
        kopf.event(body, type="Normal", reason=phase, message=message)


@kopf.on.update(*BATCHJOBS, field="spec")
def refuse_spec_change(body: kopf.Body, status: kopf.Status, **_: Any) -> None:
    if status.get("jobId"):
        kopf.warn(
            body,
            reason="SpecImmutable",
            message="spec changes after submission are ignored; delete and re-create the BatchJob",
        )


@kopf.on.delete(*BATCHJOBS, timeout=SETTINGS.cancel_timeout_s)
def cancel(uid: str, status: kopf.Status, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """Cancels the planner job of a BatchJob deleted before it finished."""
    if status.get("phase") in TERMINAL_PHASES:
        return
    try:
        job_id = status.get("jobId") or _find_job_id(memo.planner, uid)
        if job_id is None:
            return
        job = job_view(memo.planner.cancel(job_id))
    except PlannerUnavailable as exc:
        raise kopf.TemporaryError(str(exc), delay=SETTINGS.retry_delay_s) from None
    except PlannerRejected as exc:
        logger.warning("planner job not cancelled (already gone or finished): %s", exc)
        return
    logger.info("planner job %s is %s", job.id, job.phase)


def _find_job_id(planner: PlannerClient, uid: str) -> str | None:
    # deleted while its submission was under way: the job may exist without status.jobId yet
    job = planner.find_job(uid)
    return job.id if job else None
