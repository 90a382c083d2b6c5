"""A job's predicted time on a device kind: its work (workload.py) turned into seconds at the
device's peak rates (devices.py) for each feature, times the calibrated seconds per unit
(calibration.py).

The features, per engine (one replica: `tensor_parallel` devices):
- prefill_compute: the prefill's matmul and attention FLOPs at peak;
- decode_compute: the decode steps' matmul and attention FLOPs at peak;
- decode_memory: the bytes decode steps read (the weights once per step, each sequence's own keys
  and values, a group's prefix once per step) at peak bandwidth;
- steps: prefill steps (prefill tokens over the step's token budget) and decode steps (decoded
  tokens over the batch: the engine's request limit, or what the KV cache holds);
- decode_tokens: one per decoded token.
Tensor parallelism adds its all-reduces to each prefill and decode step, in seconds measured per
device kind and rank count (allreduce.py), and a mixture of experts its experts' grouped GEMMs at
their kernels' measured rates (experts.py): no calibrated coefficient multiplies either.
Replicas split a job's requests evenly; each device of a replica is busy while it runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixgrove.costmodel.allreduce import (
    Curve,
    all_reduce_curve,
    all_reduce_seconds,
    all_reduces_per_step,
)
from prefixgrove.costmodel.calibration import Calibration
from prefixgrove.costmodel.devices import DeviceKind
from prefixgrove.costmodel.experts import decode_expert_s, expert_rates, prefill_expert_s
from prefixgrove.costmodel.shape import ModelShape, dtype_bytes
from prefixgrove.costmodel.workload import Workload


@dataclass(frozen=True)
class Placement:
    """Where and how the job runs: the device kind, how many devices, the engine's dtypes and
    limits (the engine's defaults for the kind where the user set none)."""

    kind: DeviceKind
    gpus: int
    tensor_parallel: int
    weight_dtype: str  # bfloat16, float16, float32 or fp8 (W8A8)
    activation_dtype: str  # what attention computes in
    kv_dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    memory_utilization: float = 0.9
    cascade: bool = True

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.tensor_parallel < 1 or self.gpus % self.tensor_parallel:
            raise ValueError(
                f"gpus={self.gpus} with tensor_parallel_size={self.tensor_parallel} is invalid: "
                "expected gpus a positive multiple of the tensor-parallel size"
            )

    @property
    def replicas(self) -> int:
        return self.gpus // self.tensor_parallel


@dataclass(frozen=True)
class Prediction:
    prefill_s: float  # one engine's seconds, over the whole job
    decode_s: float
    batch: float  # sequences decoding at once
    features: dict[str, float]
    calibration: str  # the table's row, "KIND/DTYPE"
    borrowed: bool  # the row is another kind's
    all_reduces_measured: bool = True  # False: tensor parallel on a kind without a curve

    @property
    def engine_s(self) -> float:
        return self.prefill_s + self.decode_s

    def wall_s(self, placement: Placement) -> float:
        return self.engine_s / placement.replicas

    def gpu_hours(self, placement: Placement) -> float:
        return self.engine_s * placement.tensor_parallel / 3600


def features(work: Workload, shape: ModelShape, where: Placement, cal: Calibration) -> dict[str, float]:  # fmt: skip
    """The job's features (module docstring) on one engine of `where`."""
    c, t = cal.coefficients, where.tensor_parallel
    # W8A8 weights multiply in fp8: the linear layers run at the kind's fp8 rate
    matmul = (c.peak_flops or where.kind.flops(where.weight_dtype)) * t
    attention = (c.peak_flops or where.kind.flops(where.activation_dtype)) * t
    bandwidth = (c.bytes_per_s or where.kind.bytes_per_s) * t
    # the experts are priced apart (experts.py) on the kinds where their kernels were measured
    apart = expert_rates(where.kind.name) is not None
    linear = 2.0 * (shape.active_params - (shape.active_expert_params if apart else 0))
    dtype = where.weight_dtype
    weights = shape.weight_bytes(dtype) - (shape.expert_weight_bytes(dtype) if apart else 0)
    head = 2.0 * shape.head_params
    batch = batch_size(work, shape, where)
    decode_steps = max(work.decode_tokens / batch, work.longest_decode) if batch else 0.0
    kv = shape.kv_bytes_per_token(where.kv_dtype)
    prefill_steps = math.ceil(work.prefill_tokens / where.max_num_batched_tokens)
    return {
        "prefill_compute": (work.prefill_tokens * linear + work.requests * head) / matmul
        + shape.attention_flops(work.prefill_pairs) / attention,
        "decode_compute": work.decode_tokens * (linear + head) / matmul
        + shape.attention_flops(work.decode_pairs) / attention,
        "decode_memory": (decode_steps * weights + work.decode_kv_reads * kv) / bandwidth,
        "prefill_steps": prefill_steps,
        "decode_steps": decode_steps,
        "decode_tokens": float(work.decode_tokens),
        "batch": batch,
        "prefill_all_reduce": _all_reduce_s(
            shape, where, prefill_steps, work.prefill_tokens / max(prefill_steps, 1)
        ),
        "decode_all_reduce": _all_reduce_s(shape, where, decode_steps, batch),
        "prefill_experts": prefill_expert_s(shape, where.kind, dtype, work.prefill_tokens, t),
        "decode_experts": decode_expert_s(shape, where.kind, dtype, decode_steps, batch, t),
    }


def _curve(where: Placement) -> Curve | None:
    """The all-reduce curve of `where`'s ranks; None without tensor parallelism or where its kind's
    all-reduces were never measured."""
    if where.tensor_parallel == 1:
        return None
    return all_reduce_curve(where.kind.name, where.tensor_parallel)


def _all_reduce_s(shape: ModelShape, where: Placement, steps: float, rows: float) -> float:
    """Seconds of the all-reduces of `steps` steps of `rows` rows each (0 where `_curve` is None)."""
    curve = _curve(where)
    if curve is None or not steps:
        return 0.0
    nbytes = rows * shape.hidden * dtype_bytes(where.activation_dtype)
    return steps * all_reduces_per_step(shape.layers) * all_reduce_seconds(curve, nbytes)


def predict(work: Workload, shape: ModelShape, where: Placement, cal: Calibration) -> Prediction:
    """One engine's prefill and decode seconds for the whole job."""
    f = features(work, shape, where, cal)
    c = cal.coefficients
    prefill = (
        c.prefill_compute * f["prefill_compute"]
        + c.steps * f["prefill_steps"]
        + f["prefill_all_reduce"]
        + f["prefill_experts"]
    )
    decode = (
        c.decode_compute * f["decode_compute"]
        + c.decode_memory * f["decode_memory"]
        + c.steps * f["decode_steps"]
        + c.decode_tokens * f["decode_tokens"]
        + f["decode_all_reduce"]
        + f["decode_experts"]
    )
    measured = where.tensor_parallel == 1 or _curve(where) is not None
    return Prediction(prefill, decode, f["batch"], f, cal.key, cal.borrowed, measured)


def fit_row(f: dict[str, float]) -> list[float]:
    """The features in the order of the coefficients (calibration.FEATURES), for fitting."""
    return [f["prefill_compute"], f["decode_compute"], f["decode_memory"],
            f["prefill_steps"] + f["decode_steps"], f["decode_tokens"]]  # fmt: skip


def batch_size(work: Workload, shape: ModelShape, where: Placement) -> float:
    """Sequences decoding at once: the request limit, the job's sequences, and what the KV cache
    left beside the weights holds (no bound on the CPU kind, whose memory the table does not
    know)."""
    batch = float(min(where.max_num_seqs, work.sequences))
    if where.kind.memory_bytes and work.held_per_sequence:
        free = where.kind.memory_bytes * where.memory_utilization * where.tensor_parallel
        free -= shape.weight_bytes(where.weight_dtype)
        if free <= 0:
            raise ValueError(
                f"the weights ({shape.weight_bytes(where.weight_dtype) / 2**30:.1f} GiB) do not fit "
                f"{where.tensor_parallel} {where.kind.name}: pass a larger --tensor-parallel-size"
            )
        held = work.held_per_sequence * shape.kv_bytes_per_token(where.kv_dtype)
        batch = min(batch, free / held)
    return batch
