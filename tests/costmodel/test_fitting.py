"""Fitting coefficients to measured runs."""

from __future__ import annotations

import numpy as np
import pytest

from prefixgrove.costmodel.calibration import FEATURES
from prefixgrove.costmodel.fitting import fit, nnls

TRUE = {"prefill_compute": 1.6, "decode_compute": 1.2, "decode_memory": 1.1, "steps": 0.002,
        "decode_tokens": 0.0}  # fmt: skip


def runs(count: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    rows = rng.uniform(1, 50, (count, len(FEATURES))) * np.array([1, 1, 1, 1000, 1e4])
    return rows, rows @ np.array([TRUE[name] for name in FEATURES])


def test_fit_recovers_the_coefficients_that_made_the_runs() -> None:
    rows, seconds = runs(12)
    fitted = fit(rows.tolist(), seconds.tolist())
    for name in FEATURES:
        assert fitted[name] == pytest.approx(TRUE[name], abs=1e-6)


def test_fit_keeps_fixed_coefficients_and_fits_the_rest() -> None:
    rows, seconds = runs(8)
    fitted = fit(rows.tolist(), seconds.tolist(), fixed={"steps": 0.002, "decode_tokens": 0.0})
    assert fitted["steps"] == 0.002 and fitted["prefill_compute"] == pytest.approx(1.6)


def test_nnls_never_returns_a_negative_coefficient() -> None:
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    b = np.array([3.0, 2.0, 1.0])  # the unconstrained slope is negative
    x = nnls(a, b)
    assert (x >= 0).all() and x[1] == 0.0 and x[0] == pytest.approx(2.0)


def test_fit_refuses_runs_without_seconds() -> None:
    with pytest.raises(ValueError, match="seconds > 0"):
        fit([[1.0] * len(FEATURES)], [0.0])
