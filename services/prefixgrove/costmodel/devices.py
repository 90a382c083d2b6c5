"""The device kinds a plan is made for: each kind's peak dense matmul rate per dtype, its memory
bandwidth and size (the vendors' data sheets, SXM boards where there are several), and the batch
limits the engine takes on it by default (engine/batch_defaults.py: a test keeps them equal).

The CPU kind has no data sheet: its rates are whatever `benchmarks/calibrate.py --kind cpu`
measured on the machine it ran on, and they live in the calibration table beside its
efficiencies (calibration.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_TERA = 1e12
_GIB = 1 << 30


@dataclass(frozen=True)
class DeviceKind:
    name: str
    peak_flops: dict[str, float] = field(default_factory=dict)  # compute dtype -> FLOP/s
    bytes_per_s: float = 0.0  # memory bandwidth
    memory_bytes: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192

    def flops(self, compute_dtype: str) -> float:
        if compute_dtype not in self.peak_flops:
            raise ValueError(
                f"{self.name} has no {compute_dtype} matmuls; it runs "
                f"{', '.join(sorted(self.peak_flops))}"
            )
        return self.peak_flops[compute_dtype]


def _gpu(
    name: str, bf16: float, fp8: float | None, fp32: float, tb_s: float, gib: int
) -> DeviceKind:
    rates = {"bfloat16": bf16 * _TERA, "float16": bf16 * _TERA, "float32": fp32 * _TERA}
    if fp8 is not None:
        rates["fp8"] = fp8 * _TERA
    large = gib >= 60  # batch_defaults' large class (at least 60 GiB)
    return DeviceKind(name, rates, tb_s * _TERA, gib * _GIB, 512 if large else 256,
                      16384 if large else 8192)  # fmt: skip


# float32 on a GPU: the engine leaves TF32 off, so its matmuls take the plain FP32 units' rate
KINDS: dict[str, DeviceKind] = {
    "h100": _gpu("h100", 989.4, 1978.9, 66.9, 3.35, 80),
    "h200": _gpu("h200", 989.4, 1978.9, 66.9, 4.8, 141),
    "a100": _gpu("a100", 312.0, None, 19.5, 2.039, 80),
    "l40s": _gpu("l40s", 362.05, 733.0, 91.6, 0.864, 48),
    "cpu": DeviceKind("cpu", max_num_seqs=256, max_num_batched_tokens=2048),
}


def device_kind(name: str) -> DeviceKind:
    if name not in KINDS:
        raise ValueError(f"gpu {name!r} is not a kind the cost model knows: {', '.join(KINDS)}")
    return KINDS[name]
