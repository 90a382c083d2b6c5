"""The efficiencies the cost model runs at, per device kind and dtype: one `Coefficients` each,
read from the committed table (calibration_table.py, which `benchmarks/calibrate.py` rewrites
from runs on the device). A kind with no row of its own borrows the row of a kind that has one,
and the plan says so."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from prefixgrove.costmodel import calibration_table

FEATURES = ("prefill_compute", "decode_compute", "decode_memory", "steps", "decode_tokens")
# whose row a kind without its own borrows: the closest kind measured
_BORROW = {"h200": "h100", "a100": "h100", "l40s": "h100", "h100": "h200"}


@dataclass(frozen=True)
class Coefficients:
    """Seconds per unit of each feature (predict.py): the compute and memory features are
    seconds at the device's peak, so their coefficients are 1 / efficiency; `steps` is seconds of
    each step's fixed cost, `decode_tokens` seconds of host work per decoded token."""

    prefill_compute: float
    decode_compute: float
    decode_memory: float
    steps: float
    decode_tokens: float
    source: str  # which runs the row was fitted to
    peak_flops: float = 0.0  # the CPU kind only: its measured matmul rate
    bytes_per_s: float = 0.0  # the CPU kind only: its measured copy rate

    def weights(self) -> list[float]:
        return [getattr(self, name) for name in FEATURES]

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Calibration:
    coefficients: Coefficients
    key: str  # the row used, "KIND/DTYPE"
    borrowed: bool  # the row is another kind's: no run of this kind was fitted


def calibration_for(kind: str, dtype: str) -> Calibration:
    """The row of `kind` running `dtype` (a weight dtype: bfloat16, float16, float32 or fp8), or
    the nearest kind's row for the same dtype; ValueError when no kind has one."""
    table = calibration_table.TABLE
    dtype = "bfloat16" if dtype == "float16" else dtype  # the same tensor cores, the same rate
    own = f"{kind}/{dtype}"
    if own in table:
        return Calibration(_coefficients(own), own, False)
    other = f"{_BORROW.get(kind, '')}/{dtype}"
    if other in table and kind != "cpu":
        return Calibration(_coefficients(other), other, True)
    known = ", ".join(sorted(table))
    raise ValueError(
        f"no calibration for {dtype} on {kind}: the table has {known} "
        "(benchmarks/calibrate.py adds a row from runs on that device)"
    )


def _coefficients(key: str) -> Coefficients:
    """The row under `key`; a row fitted to several kinds' runs together stands under the first
    kind's key, and the others' keys name it."""
    row = calibration_table.TABLE[key]
    if isinstance(row, str):
        row = calibration_table.TABLE[row]
    assert not isinstance(row, str), f"{key}: a row names a row that names another"
    return Coefficients(**row)
