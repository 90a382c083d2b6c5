"""Tensor parallelism in the cost model: the measured all-reduce curves, and the canonical job's
predicted seconds at 2 and 4 ranks against the runs on four H200s (benchmarks/RESULTS.md)."""

from __future__ import annotations

import pytest
from test_predict import LLAMA_8B, shared_job

from prefixgrove.costmodel.allreduce import (
    MEASURED,
    all_reduce_curve,
    all_reduce_seconds,
    all_reduces_per_step,
)
from prefixgrove.costmodel.calibration import calibration_for
from prefixgrove.costmodel.devices import device_kind
from prefixgrove.costmodel.placement import placement
from prefixgrove.costmodel.predict import Prediction, predict
from prefixgrove.costmodel.shape import ModelShape
from prefixgrove.engine_settings import EngineSettings

CURVE = MEASURED[("h200", 4)]


def test_the_curve_gives_its_measured_points_and_interpolates_between_them() -> None:
    for nbytes, seconds in CURVE:
        assert all_reduce_seconds(CURVE, nbytes) == pytest.approx(seconds)
    (b0, t0), (b1, t1) = CURVE[1], CURVE[2]
    assert all_reduce_seconds(CURVE, (b0 + b1) / 2) == pytest.approx((t0 + t1) / 2)


def test_below_the_curve_the_floor_beyond_it_the_last_slope() -> None:
    assert all_reduce_seconds(CURVE, 16) == CURVE[0][1]  # latency bound: no cheaper than 8 KB
    (b0, t0), (b1, t1) = CURVE[-2], CURVE[-1]
    far = b1 + 10 * (b1 - b0)
    assert all_reduce_seconds(CURVE, far) == pytest.approx(t1 + 10 * (t1 - t0))


def test_the_h100_takes_the_h200s_fabric_and_other_kinds_have_no_curve() -> None:
    assert all_reduce_curve("h100", 2) == MEASURED[("h200", 2)]
    assert all_reduce_curve("a100", 2) is None
    assert all_reduce_curve("h200", 8) is None
    assert all_reduces_per_step(32) == 65


def _canonical(kind: str, tp: int) -> Prediction:
    settings = EngineSettings(device="cuda", tensor_parallel_size=tp)
    where = placement(settings, LLAMA_8B, device_kind(kind), tp)
    cal = calibration_for(kind, where.weight_dtype)
    return predict(shared_job(400, 16, 2000, 200, 100), ModelShape.from_hf_config(LLAMA_8B), where, cal)  # fmt: skip


@pytest.mark.parametrize(("tp", "measured"), [(2, 48.87), (4, 31.30)])
def test_the_canonical_job_on_h200s_within_15_percent_of_its_runs(tp: int, measured: float) -> None:
    prediction = _canonical("h200", tp)
    assert prediction.all_reduces_measured
    assert prediction.features["decode_all_reduce"] > 0 < prediction.features["prefill_all_reduce"]
    assert prediction.engine_s == pytest.approx(measured, rel=0.15)


def test_a_kind_without_a_curve_leaves_the_all_reduces_out_and_says_so() -> None:
    prediction = _canonical("a100", 2)
    assert not prediction.all_reduces_measured
    assert (
        prediction.features["decode_all_reduce"] == 0 == prediction.features["prefill_all_reduce"]
    )
    assert _canonical("h200", 1).features["decode_all_reduce"] == 0
