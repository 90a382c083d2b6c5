"""What tensor parallelism adds to a step beyond its share of the FLOPs and bytes: the all-reduces.

A step of a tensor-parallel engine sums partial results over its ranks twice a layer (after the
attention's output projection and after the MLP's down projection) and once after the
vocabulary-parallel embedding, each over the step's rows x hidden in the activation dtype. Their
time does not shrink with the rank count: at 4 ranks NCCL's 20-50 us per all-reduce took a third
of an 8B decode step (benchmarks/RESULTS.md, "Tensor parallelism"). It is no calibrated
efficiency but a measured curve, per device kind and rank count: microseconds per all-reduce
against its bytes (`benchmarks/tp.py allreduce`, the way the engine takes, replayed from a CUDA
graph as the decode graphs hold it), interpolated between the measured sizes and extended along
the last segment's slope beyond them (a prefill step's 16,384 rows are 134 MB at hidden 4,096).
"""

from __future__ import annotations

from bisect import bisect_left

# (kind, ranks) -> (bytes, seconds) per all-reduce, smallest first, on H200s of one host (NVLink 4,
# multicast off). Two ranks: the peer-memory all-reduce the engine takes up to 8 MiB (`tp.py
# allreduce --tp-sizes 2 --rows 1,16,64,128,256,512`, then --hidden 8192), 2026-11-29; beyond it
# NCCL, whose large-message slope is about the last segment's. Four ranks: NCCL (`--tp-sizes 4`,
# 2026-11-28), the peer all-reduce not yet measured there, so TP = 4's predictions run long.
Curve = tuple[tuple[int, float], ...]
MEASURED: dict[tuple[str, int], Curve] = {
    ("h200", 2): ((8192, 6.52e-6), (131072, 7.83e-6), (524288, 10.89e-6), (1048576, 14.70e-6),
                  (2097152, 18.89e-6), (4194304, 26.63e-6), (8388608, 40.88e-6)),
    ("h200", 4): ((8192, 19.61e-6), (524288, 24.14e-6), (2097152, 37.06e-6), (4194304, 50.21e-6)),
}  # fmt: skip
# the H100 SXM's NVLink 4 is the H200's fabric, at the same 900 GB/s
_SAME_FABRIC = {"h100": "h200"}


def all_reduce_curve(kind: str, ranks: int) -> Curve | None:
    """The measured curve of `ranks` ranks of `kind` (or of the kind on the same fabric); None
    where nothing was measured (the prediction then leaves the all-reduces out, and says so)."""
    return MEASURED.get((kind, ranks)) or MEASURED.get((_SAME_FABRIC.get(kind, ""), ranks))


def all_reduce_seconds(curve: Curve, nbytes: float) -> float:
    """Seconds of one all-reduce of `nbytes` on `curve`: linear between its points, the first
    point's time below them, the last segment's slope beyond them."""
    sizes = [size for size, _ in curve]
    i = min(max(bisect_left(sizes, nbytes), 1), len(curve) - 1)
    (b0, t0), (b1, t1) = curve[i - 1], curve[i]
    return max(curve[0][1], t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0))


def all_reduces_per_step(layers: int) -> int:
    """Two a layer and one after the embedding."""
    return 2 * layers + 1
