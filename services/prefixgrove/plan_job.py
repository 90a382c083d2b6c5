"""`prefixgrove plan`: a job's plan and predicted cost before it runs, with no device and no
Redis. The job is read, tokenized and grouped exactly as `prefixgrove run` reads it (the same
ingest and grouping, under the context the engine would give it on the chosen kind); nothing is
held per request but a few numbers (jobs/job_tally.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixgrove.catalog.context import engine_context
from prefixgrove.catalog.presets import load_hf_config
from prefixgrove.costmodel.devices import KINDS
from prefixgrove.costmodel.placement import placement_on
from prefixgrove.costmodel.shape import ModelShape
from prefixgrove.engine_settings import EngineSettings
from prefixgrove.input_lines import line_batches
from prefixgrove.jobs.ingest import JobIngestor, JobPlan
from prefixgrove.jobs.job_estimate import JobEstimate, estimate
from prefixgrove.jobs.job_tally import JobTally
from prefixgrove.jobs.tokenize import PromptTokenizer
from prefixgrove.settings import IngestSettings, PlanSettings, served_names

progress = logging.getLogger("prefixgrove.plan")
_READ_LINES = 4096


@dataclass(frozen=True)
class PlannedJob:
    estimate: JobEstimate
    lines: int  # request lines read
    read_s: float  # reading, tokenizing and grouping here


@dataclass(frozen=True)
class ReadJob:
    """A job read, tokenized and grouped, and the model's config."""

    tally: JobTally
    plan: JobPlan
    hf_config: Any
    lines: int  # request lines read
    invalid: int  # of them, lines that failed (they would fail as error lines)


def read_job(
    input_path: Path | str,
    model: str,
    ingest: IngestSettings,
    engine: EngineSettings,
    gpu: str,
    served_model_name: str | Sequence[str] = "",
) -> ReadJob:
    """Reads, tokenizes and groups the job as `prefixgrove run` would on a device of kind `gpu`
    (its context limit); ValueError when the whole input is not a batch."""
    hf_config = load_hf_config(model)
    requested = ingest.max_model_len or engine.max_model_len
    limit = engine_context(hf_config, requested, on_gpu=gpu != "cpu")
    joined = served_model_name if isinstance(served_model_name, str) else ",".join(served_model_name)  # fmt: skip
    names = served_names(joined) or [model]
    aliases = dict.fromkeys(names[1:], names[0])
    ingestor = JobIngestor({names[0]: PromptTokenizer(model, limit)}, ingest, aliases=aliases)
    tally, invalid = JobTally(), 0
    progress.info("reading and tokenizing %s", input_path)
    for lines in line_batches(input_path, ingest.max_line_bytes, _READ_LINES):
        batch = ingestor.add(lines)
        tally.add(batch)
        invalid += len(batch.errors)
    problem = ingestor.job_error()
    if problem is not None:
        raise ValueError(f"{problem[0]}: {problem[1]}")
    progress.info("grouping %d requests by shared prefix", len(tally))
    plan = ingestor.plan()[names[0]]
    return ReadJob(tally, plan, hf_config, ingestor.total, invalid)


def plan_file(
    input_path: Path | str,
    model: str,
    ingest: IngestSettings,
    engine: EngineSettings,
    request: PlanSettings,
    served_model_name: str | Sequence[str] = "",
) -> PlannedJob:
    """Reads, tokenizes and groups the job, then predicts it on every GPU kind (and the CPU when
    it is the kind asked for). Raises ValueError when the whole input is not a batch."""
    start = time.perf_counter()
    job = read_job(input_path, model, ingest, engine, request.gpu, served_model_name)
    kinds = [k for k in KINDS if k != "cpu" or request.gpu == "cpu"]
    where = {k: placement_on(engine, job.hf_config, k, request.gpus) for k in kinds}
    result = estimate(job.tally, job.plan, ModelShape.from_hf_config(job.hf_config), where,
                      job.invalid, request.mean_output_tokens, request.price_per_gpu_hour,
                      grouping=engine.enable_prefix_grouping)  # fmt: skip
    return PlannedJob(result, job.lines, time.perf_counter() - start)
