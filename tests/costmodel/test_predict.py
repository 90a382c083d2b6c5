"""The cost model's predictions: the committed table reproduces the measured figures it was fitted
to (benchmarks/RESULTS.md), and the model's rules on devices and dtypes."""

from __future__ import annotations

import numpy as np
import pytest

from prefixgrove.catalog.presets import load_hf_config
from prefixgrove.costmodel.calibration import calibration_for
from prefixgrove.costmodel.devices import KINDS, device_kind
from prefixgrove.costmodel.placement import placement
from prefixgrove.costmodel.predict import predict
from prefixgrove.costmodel.shape import ModelShape
from prefixgrove.costmodel.workload import RequestTable, Workload
from prefixgrove.engine.batch_defaults import CPU, LARGE_GPU, SMALL_GPU
from prefixgrove.engine_settings import EngineSettings

LLAMA_8B = load_hf_config("llama-3.1-8b-random")


def shared_job(groups: int, per_group: int, prefix: int, own: int, output: int) -> Workload:
    n = groups * per_group
    requests = RequestTable(
        np.full(n, prefix + own), np.full(n, prefix if per_group > 1 else 0),
        np.repeat(np.arange(groups), per_group) if per_group > 1 else np.full(n, -1),
        np.ones(n, dtype=np.int64),
    )  # fmt: skip
    return Workload.of(requests, np.full(n, output))


def seconds(work: Workload, kind: str, **engine: object) -> float:
    settings = EngineSettings(device="cuda", **engine)  # type: ignore[arg-type]
    where = placement(settings, LLAMA_8B, device_kind(kind), 1)
    cal = calibration_for(kind, where.weight_dtype)
    return predict(work, ModelShape.from_hf_config(LLAMA_8B), where, cal).engine_s


@pytest.mark.parametrize(
    ("name", "work", "kind", "engine", "measured"),
    [
        ("canonical bf16", shared_job(400, 16, 2000, 200, 100), "h100", {}, 6400 / 79.91),
        ("no sharing", shared_job(1000, 1, 0, 1000, 200), "h100",
         {"max_num_seqs": 256, "max_num_batched_tokens": 8192}, 1000 / 23.90),
        ("decode-heavy", shared_job(1024, 1, 0, 128, 1024), "h100", {"max_num_seqs": 256}, 67.09),
        ("decode-heavy, H200", shared_job(1024, 1, 0, 128, 1024), "h200", {}, 51.14),
        ("canonical fp8", shared_job(400, 16, 2000, 200, 100), "h100", {"quantization": "fp8"},
         6400 / 113.47),
    ],
)  # fmt: skip
def test_the_table_reproduces_the_runs_it_was_fitted_to(
    name: str, work: Workload, kind: str, engine: dict, measured: float
) -> None:
    assert seconds(work, kind, **engine) == pytest.approx(measured, rel=0.15), name


def test_each_kinds_batch_limits_are_the_engines_defaults_there() -> None:
    for kind in ("h100", "h200", "a100"):
        limits = (KINDS[kind].max_num_seqs, KINDS[kind].max_num_batched_tokens)
        assert limits == (LARGE_GPU.max_num_seqs, LARGE_GPU.max_num_batched_tokens)
    assert (KINDS["l40s"].max_num_seqs, KINDS["l40s"].max_num_batched_tokens) == (
        SMALL_GPU.max_num_seqs, SMALL_GPU.max_num_batched_tokens)  # fmt: skip
    assert (KINDS["cpu"].max_num_seqs, KINDS["cpu"].max_num_batched_tokens) == (
        CPU.max_num_seqs, CPU.max_num_batched_tokens)  # fmt: skip


def test_a_larger_job_takes_longer_and_fp8_takes_less() -> None:
    small, large = shared_job(100, 16, 2000, 200, 100), shared_job(400, 16, 2000, 200, 100)
    assert seconds(large, "h100") > 3 * seconds(small, "h100")
    assert seconds(large, "h100", quantization="fp8") < seconds(large, "h100")


def test_weights_that_do_not_fit_ask_for_more_tensor_parallel_devices() -> None:
    config = load_hf_config("llama-3.1-70b-random")
    where = placement(EngineSettings(device="cuda"), config, device_kind("l40s"), 1)
    work = shared_job(10, 1, 0, 100, 10)
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        predict(work, ModelShape.from_hf_config(config), where, calibration_for("l40s", "bfloat16"))


def test_a_kind_without_runs_borrows_a_measured_kinds_row() -> None:
    borrowed = calibration_for("a100", "bfloat16")
    assert borrowed.borrowed and borrowed.key == "h100/bfloat16"
    assert not calibration_for("h100", "bfloat16").borrowed


def test_fp8_is_refused_on_a_kind_without_fp8_tensor_cores() -> None:
    with pytest.raises(ValueError, match="a100 has none"):
        placement(EngineSettings(quantization="fp8"), LLAMA_8B, device_kind("a100"), 1)


def test_a_kind_the_model_does_not_know_is_named_with_those_it_does() -> None:
    with pytest.raises(ValueError, match="h100, h200, a100, l40s, cpu"):
        device_kind("tpu")
