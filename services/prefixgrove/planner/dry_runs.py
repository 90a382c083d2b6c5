"""Dry runs on the planner (CreateJob with dry_run): the plan options checked at creation, and at
the seal the job's plan instead of its queued groups, from the same tally, grouping and cost model
as `prefixgrove plan` (docs/plan.md); answered in Job.plan."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import Any

import grpc

from prefixgrove.catalog.presets import load_hf_config
from prefixgrove.costmodel.devices import KINDS, device_kind
from prefixgrove.costmodel.placement import placement_on
from prefixgrove.costmodel.shape import ModelShape
from prefixgrove.engine_settings import EngineSettings
from prefixgrove.jobs.ingest import JobPlan
from prefixgrove.jobs.job_estimate import estimate
from prefixgrove.jobs.job_tally import JobTally
from prefixgrove.jobs.redis_store.dry_runs import DryRuns
from prefixgrove.jobs.redis_store.schema import JobRecord, JobState
from prefixgrove_proto import planner_pb2 as pb

log = logging.getLogger(__name__)


def plan_options(options: pb.PlanOptions, context: grpc.ServicerContext) -> dict[str, Any]:
    """The options as the job keeps them, each checked (INVALID_ARGUMENT naming the value)."""
    found: dict[str, Any] = {
        "gpu": options.gpu or "h100",
        "gpus": options.gpus or 1,
        "tensor_parallel_size": options.tensor_parallel_size or 1,
        "quantization": options.quantization or None,
        "kv_cache_dtype": options.kv_cache_dtype or "auto",
        "price_per_gpu_hour": options.price_per_gpu_hour or None,
        "mean_output_tokens": options.mean_output_tokens or None,
    }
    try:
        device_kind(found["gpu"])
        _engine(found)
        for name in ("gpus", "price_per_gpu_hour", "mean_output_tokens"):
            value = found[name]
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"plan_options.{name}={value} is invalid: expected > 0")
    except ValueError as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"dry run: {exc}")
    return found


def _engine(options: dict[str, Any]) -> EngineSettings:
    return EngineSettings(quantization=options["quantization"],
                          kv_cache_dtype=options["kv_cache_dtype"],
                          tensor_parallel_size=options["tensor_parallel_size"])  # fmt: skip


# what a job that is not a dry run is planned for (its ETA until requests finish): one engine of
# the kind the cost model's table knows best
DEFAULT_OPTIONS: dict[str, Any] = {
    "gpu": "h100", "gpus": 1, "tensor_parallel_size": 1, "quantization": None,
    "kv_cache_dtype": "auto", "price_per_gpu_hour": None, "mean_output_tokens": None,
}  # fmt: skip


class DryRunPlanner:
    """Plans sealed jobs: a dry run ends with its plan; any other job keeps one for its ETA."""

    def __init__(self, dry_runs: DryRuns, sources: Mapping[str, str], aliases: Mapping[str, str]) -> None:  # fmt: skip
        self.dry_runs = dry_runs
        self.sources = sources  # served model name -> what loads its config
        self.aliases = aliases  # alias -> served model name
        self._configs: dict[str, Any] = {}  # by source: a GGUF file's config takes seconds to read

    def mark(self, job_id: str, options: dict[str, Any]) -> str:
        """Makes the new job a dry run for `options` (plan_options); returns what it holds."""
        return self.dry_runs.mark(job_id, options)

    def end(self, job: JobRecord, lines: int, plans: dict[str, JobPlan], tally: JobTally | None) -> JobState:  # fmt: skip
        """Plans the dry run's lines of its own model (`tally`, else read back from Redis) and
        ends it, completed, with that plan."""
        if tally is None:
            tally = JobTally()
            for index, prompt, params, model in self.dry_runs.requests(job.id, lines):
                if model is None or self.aliases.get(model, model) == job.model:
                    tally.add_request(index, prompt, params)
        plan = plans[job.model]
        found = self.plan(job, tally, plan, json.loads(job.dry_run))
        return self.dry_runs.end(job.id, found, plan.prefix_tokens_saved)

    def keep(self, job: JobRecord, tally: JobTally, plans: dict[str, JobPlan]) -> None:
        """Keeps a queued job's plan (DEFAULT_OPTIONS), from which its ETA starts; a plan that
        cannot be made leaves the job without one (its ETA then starts at its first results)."""
        try:
            found = self.plan(job, tally, plans[job.model], DEFAULT_OPTIONS)
        except Exception:  # NOTE: a plan is an estimate; it never stops the job it is for
            log.exception("job %s: no plan, its ETA waits for its first results", job.id)
            return
        self.dry_runs.keep(job.id, found)

    def plan(self, job: JobRecord, tally: JobTally, plan: JobPlan, options: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        """The job's plan for `options`, the kind planned for first."""
        source = self.sources[job.model]
        if source not in self._configs:
            self._configs[source] = load_hf_config(source)
        hf_config = self._configs[source]
        engine = _engine(options)
        kinds = [options["gpu"], *(k for k in KINDS if k not in ("cpu", options["gpu"]))]
        where = {k: placement_on(engine, hf_config, k, options["gpus"]) for k in kinds}
        result = estimate(tally, plan, ModelShape.from_hf_config(hf_config), where,
                          job.failed, options["mean_output_tokens"],
                          options["price_per_gpu_hour"])  # fmt: skip
        return result.as_dict()


def plan_to_pb(plan_json: str) -> pb.JobPlan:
    """A dry run's plan as the job record holds it -> its message."""
    p = json.loads(plan_json)
    low, high = p["output_tokens_range"]
    return pb.JobPlan(
        requests=p["requests"], invalid_lines=p["invalid_lines"],
        prompt_tokens=p["prompt_tokens"], prefill_tokens=p["prefill_tokens"],
        saved_share=p["saved_share"], groups=p["groups"], grouped_requests=p["grouped_requests"],
        group_sizes=p["group_sizes"], largest_group=p["largest_group"],
        output_tokens=p["output_tokens"], output_tokens_low=low, output_tokens_high=high,
        output_exact=p["output_exact"], mean_output_tokens=p["mean_output_tokens"] or 0.0,
        devices=[_device(kind, d) for kind, d in p["devices"].items()],
    )  # fmt: skip


def _device(kind: str, d: dict[str, Any] | str) -> pb.DevicePlan:
    if isinstance(d, str):
        return pb.DevicePlan(kind=kind, unavailable=d)
    low, high = d["wall_s_range"]
    return pb.DevicePlan(
        kind=kind, gpus=d["gpus"], tensor_parallel_size=d["tensor_parallel"],
        prefill_s=d["prefill_s"], decode_s=d["decode_s"], gpu_hours=d["gpu_hours"],
        wall_s=d["wall_s"], wall_s_low=low, wall_s_high=high, cost=d["cost"] or 0.0,
        calibration=d["calibration"], borrowed=d["borrowed"],
    )  # fmt: skip
