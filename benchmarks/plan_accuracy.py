"""The cost model's accuracy on GPU runs it was not fitted to: each run below, recorded in
benchmarks/RESULTS.md after the committed calibration table was fitted (benchmarks/calibrate.py),
is planned exactly as `prefixgrove plan` plans it (the same job file read, tokenized and grouped,
the same placement and table row) and its predicted engine seconds set against the measured ones.
Other models (Gemma, a mixture of experts, 70B) and tensor parallelism test what the fit never
saw: the model's shapes and the per-GPU rates scaled by the rank count.

No device needed. Prints one JSON line per run, then one with the largest error.
Usage: python benchmarks/plan_accuracy.py
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from calibrate import JOBS, Job, plan_job, write_job

from _common import emit, ensure_prefixgrove

ensure_prefixgrove()

from prefixgrove.costmodel.calibration import calibration_for  # noqa: E402
from prefixgrove.costmodel.predict import predict  # noqa: E402
from prefixgrove.engine_settings import EngineSettings  # noqa: E402

CANONICAL_32 = Job(512, 16, 2000, 200, 100)  # the canonical shape at 32 groups
CANONICAL_64 = Job(1024, 16, 2000, 200, 100)
CANONICAL_200 = Job(3200, 16, 2000, 200, 100)
DOCUMENTS = Job(800, 2, 1000, 32, 16, system=2000)  # two questions a document, one system prompt


@dataclass(frozen=True)
class Run:
    """A measured run: its job, model, engine settings beside the defaults, seconds and where
    RESULTS.md records it."""

    name: str
    job: Job
    seconds: float
    source: str
    model: str = "llama-3.1-8b-random"
    engine: dict[str, Any] = field(default_factory=dict)
    kind: str = "h200"
    mean_output: float | None = None  # a structured job's observed mean output tokens


_H200 = "RESULTS.md, H200 2026-11-28"
_H200_29 = "RESULTS.md, two H200s 2026-11-29"
_ONE_29 = "RESULTS.md, one H200 2026-11-29"
RUNS = [
    Run("8B canonical", JOBS["canonical"], 79.11, f"{_H200}, entry points, 20c33d3"),
    Run("8B decode-heavy", JOBS["decode-heavy"], 51.89, f"{_H200}, decode.py, 20c33d3"),
    Run("8B no sharing", JOBS["no-sharing"], 35.29, f"{_H200}, throughput.py, d40b3ad"),
    Run("8B structured (JSON schema)", JOBS["structured"], 58.05,
        f"{_H200}, structured.py constrained, d40b3ad", mean_output=35.2),
    Run("8B documents behind a system prompt", DOCUMENTS, 12.66, f"{_ONE_29}, batchllm.py, 31aa7d6"),
    Run("8B documents behind a system prompt, 128 out", replace(DOCUMENTS, output=128), 20.12,
        f"{_ONE_29}, batchllm.py, 31aa7d6"),
    Run("8B canonical TP=2", JOBS["canonical"], 47.81, f"{_H200_29}, tp.py, 4ddb68e",
        engine={"tensor_parallel_size": 2}),
    Run("8B canonical TP=4", JOBS["canonical"], 31.30, f"{_H200}, tp.py, 4904b77",
        engine={"tensor_parallel_size": 4}),
    Run("70B canonical (64 groups) TP=2", CANONICAL_64, 56.88, f"{_H200_29}, tp.py, 4ddb68e",
        model="llama-3.1-70b-random", engine={"tensor_parallel_size": 2}),
    Run("70B canonical (64 groups) TP=2 FP8", CANONICAL_64, 36.22, f"{_H200_29}, tp.py, 4ddb68e",
        model="llama-3.1-70b-random", engine={"tensor_parallel_size": 2, "quantization": "fp8"}),
    Run("70B canonical (64 groups) TP=4", CANONICAL_64, 32.91, f"{_H200}, tp.py, 4904b77",
        model="llama-3.1-70b-random", engine={"tensor_parallel_size": 4}),
    Run("Gemma-3-12B canonical (200 groups)", CANONICAL_200, 73.40, f"{_H200}, batchllm.py, 20c33d3",
        model="gemma-3-12b-random"),
    Run("Qwen3-30B-A3B canonical (32 groups)", CANONICAL_32, 5.51, f"{_H200}, moe.py, 51bbff0",
        model="qwen3-30b-a3b-random"),
]  # fmt: skip


def check(run: Run, folder: Path) -> dict[str, Any]:
    engine = EngineSettings(device="cuda", **run.engine)
    path = write_job(run.job, folder, 128_000)
    planned = plan_job(path, run.model, engine, run.kind, run.mean_output)
    cal = calibration_for(run.kind, planned.where.weight_dtype)
    prediction = predict(planned.work, planned.shape, planned.where, cal)
    return {
        "run": run.name, "model": run.model, "kind": run.kind, "source": run.source,
        "tensor_parallel_size": planned.where.tensor_parallel, "row": prediction.calibration,
        "measured_s": run.seconds, "predicted_s": round(prediction.engine_s, 2),
        "error": round(prediction.engine_s / run.seconds - 1, 4),
    }  # fmt: skip


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as scratch:
        records = [check(run, Path(scratch)) for run in RUNS]
    for record in records:
        emit(record)
    worst = max(records, key=lambda r: abs(r["error"]))
    within = sum(abs(r["error"]) <= 0.15 for r in records)
    emit({"runs": len(records), "within_15_percent": within, "largest_error": worst["error"],
          "largest_error_run": worst["run"]})  # fmt: skip


if __name__ == "__main__":
    main()
