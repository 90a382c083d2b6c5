"""Calibrates the cost model (services/prefixgrove/costmodel/) and measures its accuracy.

Each job below is written as a batch file and planned by the same code as `prefixgrove plan`
(read, tokenized, grouped); its features (costmodel/predict.py) are fitted to measured seconds by
non-negative least squares, and the fitted row goes into costmodel/calibration_table.py.

  python benchmarks/calibrate.py --recorded
      no device: refits the GPU rows from the figures benchmarks/RESULTS.md records (RECORDED
      below names each figure's table and commit)
  python benchmarks/calibrate.py --gpu h100 [--quantization fp8] [--tokenizer DIR]
      on the GPU: runs each job at --fit-scale (default 0.25) through `prefixgrove run`'s own
      path, fits the row, then runs each job whole and prints predicted against measured engine
      seconds (the structured job needs Llama 3's tokenizer, as structured.py does)
  python benchmarks/calibrate.py --gpu cpu --model tiny-random-llama --scale 0.02
      the CPU kind: its matmul and copy rates measured here, then the same on a tiny model

Measured: the decode phase of the local run (`RunSummary.decode_seconds`: the engine and the
answers written, not loading or reading), after a warm-up run of the same shape.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from _common import EXTRACTION_SCHEMA, ROOT, add_engine_args, emit, ensure_prefixgrove

ensure_prefixgrove()

from prefixgrove.costmodel import calibration_table  # noqa: E402
from prefixgrove.costmodel.calibration import FEATURES, Calibration, Coefficients  # noqa: E402
from prefixgrove.costmodel.fitting import fit  # noqa: E402
from prefixgrove.costmodel.placement import placement_on  # noqa: E402
from prefixgrove.costmodel.predict import Placement, features, fit_row, predict  # noqa: E402
from prefixgrove.costmodel.shape import ModelShape  # noqa: E402
from prefixgrove.costmodel.workload import Workload  # noqa: E402
from prefixgrove.engine_settings import EngineSettings  # noqa: E402
from prefixgrove.plan_job import read_job  # noqa: E402
from prefixgrove.settings import IngestSettings, load  # noqa: E402

TABLE = ROOT / "services/prefixgrove/costmodel/calibration_table.py"


@dataclass(frozen=True)
class Job:
    """A benchmark's shape: `requests` prompts, each `per_group` sharing a `prefix`-token block,
    then `own` tokens of their own, making `output` tokens (EOS ignored) or, `structured`, at most
    `output` tokens of EXTRACTION_SCHEMA's JSON; `system` tokens shared by every prompt before its
    group's block (documents behind one system prompt)."""

    requests: int
    per_group: int
    prefix: int
    own: int
    output: int
    structured: bool = False
    system: int = 0

    def scaled(self, scale: float, lengths: float = 1.0) -> Job:
        """`scale` of its requests (whole groups), each of its lengths times `lengths`."""
        groups = max(1, round(self.requests / self.per_group * scale))
        per_group = min(self.per_group, max(1, round(self.requests * scale)))
        prefix, own, output = (max(1, round(n * lengths)) if n else 0
                               for n in (self.prefix, self.own, self.output))  # fmt: skip
        return replace(self, requests=groups * per_group, per_group=per_group, prefix=prefix,
                       own=own, output=output)  # fmt: skip


JOBS = {
    "canonical": Job(6400, 16, 2000, 200, 100),  # DESIGN.md's canonical job
    "no-sharing": Job(1000, 1, 0, 1000, 200),  # throughput.py
    "decode-heavy": Job(1024, 1, 0, 128, 1024),  # decode.py
    "structured": Job(6400, 6400, 1500, 300, 200, structured=True),  # structured.py
}


@dataclass(frozen=True)
class Recorded:
    """A figure of RESULTS.md (the batch limits table now stands in HISTORY.md): the job, the
    engine's settings beside the defaults, the measured seconds, the observed mean output
    (structured), and where it is recorded."""

    job: Job
    kind: str
    seconds: float
    source: str
    engine: dict[str, Any]
    mean_output: float | None = None


_256 = {"max_num_seqs": 256}
_FP8 = {"quantization": "fp8"}
RECORDED = {
    "bfloat16": [
        Recorded(
            JOBS["canonical"], "h100", 6400 / 79.91, "canonical table, group-cascade, 2489b63", {}
        ),
        Recorded(
            Job(1600, 16, 2000, 200, 100),
            "h100",
            1600 / 78.07,
            "batch limits table, cascade 1,600, 0776c6a",
            {},
        ),
        Recorded(
            JOBS["no-sharing"],
            "h100",
            1000 / 23.90,
            "throughput.py table, 7236583",
            {**_256, "max_num_batched_tokens": 8192},
        ),
        Recorded(
            JOBS["decode-heavy"], "h100", 67.09, "decode.py table, 8 graphs bf16, 0e7a272", _256
        ),
        Recorded(
            JOBS["structured"],
            "h100",
            6400 / 113.14,
            "structured.py table, jump-forward, 04d7366",
            {},
            33.9,
        ),
        Recorded(JOBS["canonical"], "h200", 77.88, "entry points table, batchllm.py, dbddf2e", {}),
        Recorded(
            JOBS["decode-heavy"], "h200", 51.14, "decode.py table, H200 defaults, dbddf2e", {}
        ),
    ],
    "fp8": [
        Recorded(
            JOBS["canonical"],
            "h100",
            6400 / 113.47,
            "canonical table, group-cascade-fp8, 2489b63",
            _FP8,
        ),
        Recorded(
            JOBS["canonical"],
            "h100",
            6400 / 119.33,
            "canonical table, group-cascade-fp8-kv, 2489b63",
            {**_FP8, "kv_cache_dtype": "fp8"},
        ),
        Recorded(
            JOBS["decode-heavy"],
            "h100",
            1024 * 1024 / 20801,
            "decode.py table, FP8 weights and KV, 022bc5d",
            {**_256, **_FP8, "kv_cache_dtype": "fp8"},
        ),
    ],
}


def job_lines(job: Job, vocab: int, seed: int = 0) -> Iterator[str]:
    """The job as completions lines of token ids (random, below `vocab`)."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(job.system)]
    prefix: list[int] = []
    for i in range(job.requests):
        if i % job.per_group == 0:
            prefix = system + [rng.randrange(vocab) for _ in range(job.prefix)]
        body: dict[str, Any] = {
            "prompt": prefix + [rng.randrange(vocab) for _ in range(job.own)],
            "max_tokens": job.output,
            "temperature": 0,
        }
        if job.structured:
            body["structured_outputs"] = {"json": EXTRACTION_SCHEMA, "disable_any_whitespace": True}
        else:
            body["ignore_eos"] = True
        yield json.dumps({"custom_id": f"r{i}", "url": "/v1/completions", "body": body}) + "\n"


def write_job(job: Job, folder: Path, vocab: int) -> Path:
    shape = f"{job.requests}-{job.per_group}-{job.prefix}-{job.own}-{job.output}-{job.system}"
    path = folder / f"job-{shape}.jsonl"
    if not path.exists():
        with path.open("w") as out:
            out.writelines(job_lines(job, vocab))
    return path


@dataclass(frozen=True)
class Planned:
    """A job file planned: its work and where it runs."""

    work: Workload
    shape: ModelShape
    where: Placement


def plan_job(path: Path, model: str, engine: EngineSettings, kind: str, mean: float | None) -> Planned:  # fmt: skip
    read = read_job(path, model, IngestSettings(), engine, kind)
    where = placement_on(engine, read.hf_config, kind, engine.tensor_parallel_size or 1)
    if isinstance(where, str):
        raise SystemExit(f"{path.name} cannot run on {kind}: {where}")
    outputs = read.tally.outputs().expected(mean)
    table = read.tally.table(read.plan, engine.enable_prefix_grouping)
    work = Workload.of(table, outputs, where.cascade)
    return Planned(work, ModelShape.from_hf_config(read.hf_config), where)


def row_of(planned: Planned, cal: Calibration) -> list[float]:
    return fit_row(features(planned.work, planned.shape, planned.where, cal))


def unit_calibration(kind: str, dtype: str, peak_flops: float = 0.0, bytes_per_s: float = 0.0) -> Calibration:  # fmt: skip
    """A row of ones (features come out in seconds at peak), with the CPU's measured rates."""
    ones = Coefficients(1.0, 1.0, 1.0, 1.0, 1.0, "", peak_flops, bytes_per_s)
    return Calibration(ones, f"{kind}/{dtype}", False)


def fit_recorded(model: str, folder: Path) -> dict[str, Any]:
    """The GPU rows, fitted to RECORDED: bf16 on the H100 and H200 together (their rates differ,
    their efficiencies are fitted as one), FP8 with the fixed costs (steps, decoded tokens) of
    bf16's fit."""
    rows: dict[str, Any] = {}
    fixed: dict[str, float] = {}
    for dtype, figures in RECORDED.items():
        matrix, seconds = [], []
        for figure in figures:
            engine = EngineSettings(device="cuda", **figure.engine)
            path = write_job(figure.job, folder, 128_000)
            planned = plan_job(path, model, engine, figure.kind, figure.mean_output)
            matrix.append(row_of(planned, unit_calibration(figure.kind, dtype)))
            seconds.append(figure.seconds)
        keep = {k: fixed[k] for k in ("steps", "decode_tokens")} if fixed else None
        coefficients = fit(matrix, seconds, keep)
        fixed = fixed or coefficients
        sources = "; ".join(f"{f.kind} {f.source}" for f in figures)
        first, *others = sorted({f.kind for f in figures})  # one fit: written once, named
        rows[f"{first}/{dtype}"] = {**coefficients, "source": f"RESULTS.md: {sources}"}
        rows.update({f"{kind}/{dtype}": f"{first}/{dtype}" for kind in others})
        report(figures, matrix, seconds, coefficients)
        held_out(figures, matrix, seconds, keep)
    return rows


def held_out(figures: list[Recorded], matrix: list[list[float]], seconds: list[float],
             fixed: dict[str, float] | None) -> None:  # fmt: skip
    """Each figure predicted by a fit to the others (where the others are more than the
    coefficients fitted): the error on a run the fit did not see."""
    unknown = len(FEATURES) - len(fixed or {})
    if len(figures) - 1 <= unknown:
        return
    for i, figure in enumerate(figures):
        rest = [j for j in range(len(figures)) if j != i]
        c = fit([matrix[j] for j in rest], [seconds[j] for j in rest], fixed)
        predicted = sum(c[name] * value for name, value in zip(FEATURES, matrix[i], strict=True))
        emit({"held_out": figure.source, "kind": figure.kind, "measured_s": round(seconds[i], 2),
              "predicted_s": round(predicted, 2),
              "error": round(predicted / seconds[i] - 1, 4)})  # fmt: skip


def report(figures: list[Recorded], matrix: list[list[float]], seconds: list[float], c: dict[str, float]) -> None:  # fmt: skip
    for figure, row, measured in zip(figures, matrix, seconds, strict=True):
        predicted = sum(c[name] * value for name, value in zip(FEATURES, row, strict=True))
        emit({"job": figure.source, "kind": figure.kind, "measured_s": round(measured, 2),
              "predicted_s": round(predicted, 2),
              "error": round(predicted / measured - 1, 4)})  # fmt: skip


def measure(path: Path, model: str, engine: EngineSettings) -> tuple[float, float]:
    """The job through `prefixgrove run`'s path: (decode seconds, mean output tokens)."""
    from prefixgrove.local import run_local

    out = path.with_suffix(".out.jsonl")
    summary = run_local(path, out, path.with_suffix(".err.jsonl"), model, IngestSettings(),
                        engine, use_tqdm=False)  # fmt: skip
    if summary.failed:
        raise SystemExit(f"{path.name}: {summary.failed} requests failed: {summary.errors_by_code}")
    return summary.decode_seconds, summary.completion_tokens / max(summary.completed, 1)


def cpu_rates() -> tuple[float, float]:
    """This machine's float32 matmul FLOP/s and copy bytes/s (read and written), best of five."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    src, dst = torch.randn(16 << 20), torch.empty(16 << 20)
    flops = max(2 * 1024**3 / _seconds(lambda: a @ b) for _ in range(5))
    copy = max(2 * src.numel() * 4 / _seconds(lambda: dst.copy_(src)) for _ in range(5))
    return flops, copy


def _seconds(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_jobs(args: argparse.Namespace, engine: EngineSettings, cal: Calibration, scale: float,
             folder: Path) -> list[tuple[str, list[float], float, Planned]]:  # fmt: skip
    """Each job at `scale`: (name, features, measured seconds, plan)."""
    runs = []
    for name in args.jobs.split(","):
        job = JOBS[name].scaled(scale, args.lengths)
        path = write_job(job, folder, args.prompt_vocab)
        seconds, mean = measure(path, args.model, engine)
        planned = plan_job(path, args.model, engine, args.gpu, mean if job.structured else None)
        runs.append((name, row_of(planned, cal), seconds, planned))
        emit({"job": name, "scale": scale, "requests": job.requests, "measured_s": round(seconds, 3)})  # fmt: skip
    return runs


def calibrate_here(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Fits the row of this device from runs at --fit-scale, then checks it at --scale."""
    engine = load(EngineSettings, args)
    engine = engine.replace(device="cpu" if args.gpu == "cpu" else engine.device)
    if "structured" in args.jobs.split(",") and args.gpu != "cpu" and not engine.tokenizer:
        raise SystemExit("the structured job needs Llama 3's tokenizer (--tokenizer DIR, as "
                         "structured.py says), or leave it out of --jobs")  # fmt: skip
    peak, copy = cpu_rates() if args.gpu == "cpu" else (0.0, 0.0)
    dtype = plan_job(write_job(JOBS["no-sharing"].scaled(0.01, args.lengths), folder, args.prompt_vocab),
                     args.model, engine, args.gpu, None).where.weight_dtype  # fmt: skip
    ones = unit_calibration(args.gpu, dtype, peak, copy)
    measure(write_job(JOBS["canonical"].scaled(0.01, args.lengths), folder, args.prompt_vocab), args.model, engine)  # fmt: skip
    fitted = run_jobs(args, engine, ones, args.fit_scale, folder)
    c = fit([r[1] for r in fitted], [r[2] for r in fitted])
    source = (f"calibrate.py on {args.gpu}, {time.strftime('%Y-%m-%d')}: {args.jobs} at scale "
              f"{args.fit_scale}, lengths {args.lengths}, {args.model}")  # fmt: skip
    row = {**c, "source": source, "peak_flops": peak, "bytes_per_s": copy}
    cal = Calibration(Coefficients(**row), f"{args.gpu}/{dtype}", False)
    for name, _, measured, planned in run_jobs(args, engine, ones, args.scale, folder):
        p = predict(planned.work, planned.shape, planned.where, cal)
        emit({"check": name, "scale": args.scale, "measured_s": round(measured, 3),
              "predicted_s": round(p.engine_s, 3), "error": round(p.engine_s / measured - 1, 4)})  # fmt: skip
    return {f"{args.gpu}/{dtype}": row}


def write_table(rows: dict[str, Any]) -> None:
    """The table with `rows` replaced or added, formatted as the repository formats Python."""
    table = {**calibration_table.TABLE, **rows}
    body = json.dumps(dict(sorted(table.items())), indent=4)
    TABLE.write_text(
        '"""The cost model\'s calibrated coefficients, one row per device kind and weight dtype\n'
        "(costmodel/calibration.py says what each means). Written by benchmarks/calibrate.py; each\n"
        "row names the runs it was fitted to; a kind fitted together with another names that\n"
        'kind\'s row."""\n\n'
        "from typing import Any\n\n"
        f"TABLE: dict[str, dict[str, Any] | str] = {body}\n"
    )
    subprocess.run([sys.executable, "-m", "ruff", "format", str(TABLE)], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_engine_args(ap)
    ap.add_argument("--recorded", action="store_true", help="fit the GPU rows to RESULTS.md's figures")  # fmt: skip
    ap.add_argument("--gpu", default="h100", help="the kind this machine is (h100, h200, ..., cpu)")
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--fit-scale", type=float, default=0.25, help="the fitted runs' share of each job")  # fmt: skip
    ap.add_argument("--scale", type=float, default=1.0, help="the checked runs' share of each job")
    ap.add_argument("--lengths", type=float, default=1.0,
                    help="each job's prompt and output lengths times this (a small CPU)")  # fmt: skip
    ap.add_argument("--prompt-vocab", type=int, default=128_000, help="prompt ids are drawn below this")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="print the row, leave the table")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="calibrate-") as scratch:
        if args.recorded:
            rows = fit_recorded(args.model, Path(scratch))
        else:
            rows = calibrate_here(args, Path(scratch))
    emit({"rows": rows})
    if not args.dry_run:
        write_table(rows)


if __name__ == "__main__":
    sys.exit(main())
