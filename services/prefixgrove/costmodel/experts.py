"""What a mixture-of-experts layer costs beside a dense one: the fused MoE kernels' own rates.

The calibrated rows are fitted to dense models, whose matmuls see every row of a step. An expert
sees only the rows routed to it, padded to the kernel's row block, and at decode sizes a step
reads every expert it touches for a handful of rows each: the grouped GEMMs reach a smaller share
of the device than a dense matmul. So the experts are priced apart, like the all-reduces: by their
FLOPs at prefill and their weight bytes at decode, at the share of the kind's peak that the fused
kernels were measured to reach (`benchmarks/moe.py roofline`, routing and both grouped GEMMs of one
Qwen3-30B-A3B layer from a CUDA graph with a cold L2, the tiles of `moe_configs.TUNED_TILES`), with
no calibrated coefficient on top. The attention and any dense MLP stay in the calibrated features.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixgrove.costmodel.devices import DeviceKind
from prefixgrove.costmodel.shape import ModelShape


@dataclass(frozen=True)
class ExpertRates:
    prefill_flops_share: float  # of the kind's peak matmul rate, at a prefill step's tokens
    decode_bytes_share: float  # of the kind's bandwidth, reading the experts a decode step touches


# moe.py roofline and tune on an H200, 2026-11-28: 1.237 TFLOP in 2,956 us at 16,384 tokens
# (tuned tiles); the 128 experts' 1.21 GB in 342 us at 512 tokens (tuned tiles)
MEASURED = {"h200": ExpertRates(prefill_flops_share=0.423, decode_bytes_share=0.736)}
# the H100 is the H200's Hopper die: the same kernels reach the same shares of its peaks
_SAME_DIE = {"h100": "h200"}


def expert_rates(kind: str) -> ExpertRates | None:
    """The measured shares of `kind` (or of its die's twin); None where they were never measured
    (the experts then count as dense layers in the calibrated features)."""
    return MEASURED.get(kind) or MEASURED.get(_SAME_DIE.get(kind, ""))


def touched_experts(shape: ModelShape, rows: float) -> float:
    """Experts a step of `rows` rows reads, on average, when each row picks `experts_per_token`
    of them at random: E * (1 - (1 - 1/E) ** (rows * k))."""
    e = shape.experts
    return e * (1.0 - (1.0 - 1.0 / e) ** (rows * shape.experts_per_token)) if e else 0.0


def prefill_expert_s(shape: ModelShape, kind: DeviceKind, dtype: str, tokens: float, ranks: int) -> float:  # fmt: skip
    """Seconds of the experts' grouped GEMMs over `tokens` tokens at their FLOPs' measured rate
    (0 where the kind's rates were never measured)."""
    rates = expert_rates(kind.name)
    flops = 2.0 * tokens * shape.active_expert_params
    return flops / (rates.prefill_flops_share * kind.flops(dtype) * ranks) if rates else 0.0


def decode_expert_s(shape: ModelShape, kind: DeviceKind, dtype: str, steps: float, rows: float, ranks: int) -> float:  # fmt: skip
    """Seconds of the experts over `steps` decode steps of `rows` rows: the weights of the experts
    touched, read once a step, or their FLOPs where those take longer."""
    rates = expert_rates(kind.name)
    if not rates or not steps or not shape.experts:
        return 0.0
    read = shape.expert_weight_bytes(dtype) * touched_experts(shape, rows) / shape.experts
    memory = read / (rates.decode_bytes_share * kind.bytes_per_s * ranks)
    return steps * max(memory, prefill_expert_s(shape, kind, dtype, rows, ranks))
