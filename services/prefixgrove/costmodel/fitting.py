"""Fitting the coefficients to measured runs: non-negative least squares on the runs' relative
errors (each run weighs alike, whatever its length), some coefficients optionally held at known
values (a dtype with few runs keeps the fixed costs fitted to another)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from prefixgrove.costmodel.calibration import FEATURES


def fit(
    rows: Sequence[Sequence[float]],
    seconds: Sequence[float],
    fixed: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Coefficients (by FEATURES' names) >= 0 that make rows @ coefficients nearest `seconds`,
    relative to each; `fixed` names coefficients that keep their given values."""
    fixed = dict(fixed or {})
    unknown = [FEATURES.index(name) for name in FEATURES if name not in fixed]
    a = np.asarray(rows, dtype=np.float64)
    b = np.asarray(seconds, dtype=np.float64)
    if a.shape != (b.size, len(FEATURES)) or b.size == 0 or (b <= 0).any():
        raise ValueError(
            f"expected one row of {len(FEATURES)} features per run and seconds > 0, got rows of "
            f"shape {a.shape} for {b.size} runs"
        )
    known = sum(a[:, FEATURES.index(name)] * value for name, value in fixed.items())
    scale = 1.0 / b
    solved = nnls(a[:, unknown] * scale[:, None], (b - known) * scale)
    out = dict(fixed)
    for column, value in zip(unknown, solved, strict=True):
        out[FEATURES[column]] = float(value)
    return {name: out[name] for name in FEATURES}


def nnls(a: np.ndarray, b: np.ndarray, iterations: int = 200) -> np.ndarray:
    """min ||a x - b|| with x >= 0 (Lawson and Hanson's active-set method)."""
    # columns at unit scale: the features differ by orders of magnitude
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    a = a / norms
    x = np.zeros(a.shape[1])
    passive = np.zeros(a.shape[1], dtype=bool)
    for _ in range(iterations):
        gradient = a.T @ (b - a @ x)
        free = ~passive & (gradient > 1e-12)
        if not free.any():
            break
        passive[np.argmax(np.where(free, gradient, -np.inf))] = True
        while True:
            z = np.zeros_like(x)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            shrinking = passive & (z <= 0)
            alpha = np.min(x[shrinking] / (x[shrinking] - z[shrinking]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x / norms
