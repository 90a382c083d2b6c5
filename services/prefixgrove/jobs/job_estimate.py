"""A job's plan before it runs: what grouping saves, the groups' sizes, the output tokens it will
make (exact, or a range) and its predicted time and cost on each device kind. Built from the
tally of its requests and the grouping's plan, the same whoever read the job (`prefixgrove plan`,
the planner's dry run)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from prefixgrove.costmodel.calibration import calibration_for
from prefixgrove.costmodel.predict import Placement, predict
from prefixgrove.costmodel.shape import ModelShape
from prefixgrove.costmodel.workload import RequestTable, Workload
from prefixgrove.jobs.ingest import JobPlan
from prefixgrove.jobs.job_tally import JobTally

_SIZE_BUCKETS = ((2, 3), (4, 7), (8, 15), (16, 63), (64, 255), (256, None))


@dataclass(frozen=True)
class DeviceEstimate:
    kind: str
    gpus: int
    tensor_parallel: int
    prefill_s: float  # device seconds of one engine, the whole job
    decode_s: float
    gpu_hours: float
    wall_s: float  # on `gpus` devices
    wall_s_range: tuple[float, float]  # the outputs' low and high bounds
    cost: float | None  # at the price given
    calibration: str  # the table's row
    borrowed: bool  # that row was fitted to another kind's runs
    # False: tensor parallel on a kind whose all-reduces were never measured (left out of the time)
    all_reduces_measured: bool = True


@dataclass(frozen=True)
class JobEstimate:
    requests: int  # requests that run (valid lines)
    invalid_lines: int
    prompt_tokens: int
    prefill_tokens: int  # left to compute after grouping
    saved_share: float  # of the prompt tokens
    groups: int
    grouped_requests: int
    group_sizes: dict[str, int]  # "2-3": groups of that many requests
    largest_group: int
    output_tokens: int  # predicted: exact, or at the observed mean (else max_tokens)
    output_tokens_range: tuple[int, int]
    output_exact: bool  # every request's max_tokens binds
    mean_output_tokens: float | None  # the observed mean used for the others
    devices: dict[str, DeviceEstimate | str] = field(default_factory=dict)  # kind -> why not

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate(
    tally: JobTally,
    plan: JobPlan,
    shape: ModelShape,
    placements: Mapping[str, Placement | str],
    invalid_lines: int = 0,
    mean_output_tokens: float | None = None,
    price_per_gpu_hour: float | None = None,
    grouping: bool = True,
) -> JobEstimate:
    """The job's plan on each placement (kind -> Placement, or the reason it cannot run there);
    grouping: whether the engine groups by shared prefix."""
    table = tally.table(plan, grouping)
    bounds = tally.outputs()
    expected = bounds.expected(mean_output_tokens)
    work = {name: Workload.of(table, out) for name, out in
            (("low", bounds.low), ("expected", expected), ("high", bounds.high))}  # fmt: skip
    devices: dict[str, DeviceEstimate | str] = {}
    for kind, where in placements.items():
        try:
            if isinstance(where, str):
                raise ValueError(where)
            devices[kind] = _on(table, bounds, expected, shape, where, price_per_gpu_hour)
        except ValueError as exc:
            devices[kind] = str(exc)
    sizes = _group_sizes(table)
    prompt = int(table.prompt.sum())
    e = work["expected"]
    return JobEstimate(
        requests=len(table),
        invalid_lines=invalid_lines,
        prompt_tokens=prompt,
        prefill_tokens=e.prefill_tokens,
        saved_share=1 - e.prefill_tokens / prompt if prompt else 0.0,
        groups=int(sizes.size),
        grouped_requests=int(sizes.sum()),
        group_sizes=_histogram(sizes),
        largest_group=int(sizes.max()) if sizes.size else 0,
        output_tokens=e.output_tokens,
        output_tokens_range=(work["low"].output_tokens, work["high"].output_tokens),
        output_exact=bool(bounds.exact.all()),
        mean_output_tokens=mean_output_tokens,
        devices=devices,
    )


def _on(
    table: RequestTable,
    bounds: Any,
    expected: np.ndarray,
    shape: ModelShape,
    where: Placement,
    price: float | None,
) -> DeviceEstimate:
    cal = calibration_for(where.kind.name, where.weight_dtype)
    runs = [Workload.of(table, out, where.cascade) for out in (expected, bounds.low, bounds.high)]
    best, low, high = (predict(w, shape, where, cal) for w in runs)
    hours = best.gpu_hours(where)
    return DeviceEstimate(
        kind=where.kind.name,
        gpus=where.gpus,
        tensor_parallel=where.tensor_parallel,
        prefill_s=best.prefill_s,
        decode_s=best.decode_s,
        gpu_hours=hours,
        wall_s=best.wall_s(where),
        wall_s_range=(low.wall_s(where), high.wall_s(where)),
        cost=None if price is None else hours * price,
        calibration=best.calibration,
        borrowed=best.borrowed,
        all_reduces_measured=best.all_reduces_measured,
    )


def _group_sizes(table: RequestTable) -> np.ndarray:
    grouped = table.group[table.group >= 0]
    return np.unique(grouped, return_counts=True)[1] if grouped.size else np.zeros(0, np.int64)


def _histogram(sizes: np.ndarray) -> dict[str, int]:
    out = {}
    for low, high in _SIZE_BUCKETS:
        top = np.inf if high is None else high
        count = int(((sizes >= low) & (sizes <= top)).sum())
        if count:
            out[f"{low}-{high}" if high else f"{low}+"] = count
    return out
