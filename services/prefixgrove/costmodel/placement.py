"""An engine's settings on a device kind, as the cost model sees them: the dtypes it would run in
and its batch limits, each knob the user left unset resolved as the engine resolves it on that
kind (engine/config.py)."""

from __future__ import annotations

from typing import Any

from prefixgrove.costmodel.devices import DeviceKind, device_kind
from prefixgrove.costmodel.predict import Placement
from prefixgrove.engine_settings import EngineSettings

_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}


def placement(engine: EngineSettings, hf_config: Any, kind: DeviceKind, gpus: int) -> Placement:
    """Where `engine` runs the job: `gpus` devices of `kind` (the CPU kind: one engine)."""
    activation = _activation_dtype(engine, hf_config, kind.name != "cpu")
    if engine.quantization == "fp8" and "fp8" not in kind.peak_flops and kind.name != "cpu":
        raise ValueError(
            f"quantization=fp8 needs FP8 tensor cores: {kind.name} has none (h100, h200, l40s do)"
        )
    tp = engine.tensor_parallel_size or 1
    return Placement(
        kind=kind,
        gpus=gpus,
        tensor_parallel=tp,
        weight_dtype="fp8" if engine.quantization == "fp8" else activation,
        activation_dtype=activation,
        kv_dtype="fp8" if engine.kv_cache_dtype.startswith("fp8") else activation,
        max_num_seqs=engine.max_num_seqs or kind.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens
        or max(kind.max_num_batched_tokens, engine.max_num_seqs or kind.max_num_seqs),
        memory_utilization=engine.gpu_memory_utilization,
        cascade=engine.enable_cascade_attention,
    )


def placement_on(engine: EngineSettings, hf_config: Any, kind: str, gpus: int) -> Placement | str:
    """The engine on `gpus` devices of `kind` (the CPU: one engine), or why it cannot run there."""
    try:
        return placement(engine, hf_config, device_kind(kind), gpus if kind != "cpu" else 1)
    except ValueError as exc:
        return str(exc)


def _activation_dtype(engine: EngineSettings, hf_config: Any, gpu: bool) -> str:
    """The engine's dtype: the one asked for, else float32 on the CPU and the checkpoint's own
    half-precision dtype on a GPU (bfloat16 when it declares float32 or none)."""
    dtype = str(engine.dtype).removeprefix("torch.")
    if dtype != "auto":
        return _DTYPE_NAMES.get(dtype, dtype)
    if not gpu:
        return "float32"
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    declared = _DTYPE_NAMES.get(str(declared).removeprefix("torch."), str(declared).removeprefix("torch."))  # fmt: skip
    return declared if declared in ("bfloat16", "float16") else "bfloat16"
