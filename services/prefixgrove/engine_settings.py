"""Every engine knob a user may set, in one type: what `LLM(...)` takes as keyword arguments and what
`prefixgrove run` and `prefixgrove serve worker` read from their flags and PREFIXGROVE_* variables
(the services' settings loader fills it like any other settings class). It imports nothing heavy,
so that every command's flags can be built without loading torch.

Names are vLLM's engine-argument names wherever vLLM has the knob. A value left at None (or "auto")
is resolved for the device by `EngineConfig.from_settings`: the batch limits from
`engine/batch_defaults.py`, decode windows and the cascade kernels from what runs fastest
there, so `LLM(model)`, a local run, a worker and the benchmarks run the same engine from the same
inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEVICES_HELP = "auto (cuda when there is a GPU), cpu, cuda or cuda:N"
_HELP = "help"  # the settings loader's metadata key (prefixgrove.settings.HELP)


def _knob(default: Any, helptext: str) -> Any:
    return field(default=default, metadata={_HELP: helptext})


@dataclass(frozen=True)
class EngineSettings:
    device: str = _knob("auto", DEVICES_HELP)
    dtype: str | torch.dtype = _knob(  # noqa: RUF009 (a torch.dtype is immutable too)
        "auto", "the weights' and activations' dtype: auto (the checkpoint's on a GPU, float32 on "
        "the CPU), bfloat16, float16 or float32"
    )  # fmt: skip
    quantization: str | None = _knob(
        None, "fp8: W8A8 linear layers quantized at load time; unset: the weights' own dtype"
    )
    fp8_block_scales: bool = _knob(
        False, "with quantization=fp8: weights in 128x128 blocks with one scale each, activations "
        "per token and 128-column group (DeepSeek-V3's and Qwen3's FP8 layout); off: a scale per "
        "output channel and per token. Block-scaled FP8 checkpoints turn it on themselves"
    )  # fmt: skip
    kv_cache_dtype: str = _knob(
        "auto", "auto (the model's dtype) or fp8 (fp8_e4m3): twice the blocks in the same memory"
    )
    max_model_len: int | None = _knob(
        None, "the longest prompt + output; unset: the model's limit, at most 8192 on a GPU, 2048 "
        "on the CPU"
    )  # fmt: skip
    gpu_memory_utilization: float = _knob(
        0.9, "the share of the GPU's memory the engine may take (weights, activations, KV cache)"
    )
    max_num_seqs: int | None = _knob(
        None, "requests in one batch; unset: the best measured for the device (engine/batch_defaults.py)"
    )  # fmt: skip
    max_num_batched_tokens: int | None = _knob(
        None, "tokens one step computes; unset: the best measured for the device"
    )
    enable_prefix_caching: bool = _knob(
        True, "full KV blocks outlive their requests and are found again by content"
    )
    num_scheduler_steps: int | None = _knob(
        None, "decode steps per CPU round trip; unset: 8 on a GPU, 1 on the CPU"
    )
    seed: int = _knob(0, "the engine's random seed (a request's own seed wins)")
    block_size: int = _knob(16, "tokens per KV block (a power of two >= 8)")
    num_gpu_blocks_override: int | None = _knob(
        None, "KV blocks to allocate; unset: as many as the free memory holds"
    )
    enforce_eager: bool = _knob(False, "no CUDA graphs")
    tensor_parallel_size: int | None = _knob(
        None, "devices one engine spans, one process each, the model split across them; unset: "
        "1, and for a worker every GPU it was given"
    )  # fmt: skip
    disable_custom_all_reduce: bool = _knob(
        False, "tensor parallel on GPUs: every all-reduce through NCCL; off: decode-sized ones "
        "over the GPUs' peer memory where they can map it"
    )  # fmt: skip
    attention_backend: str = _knob(
        "auto", "triton, torch or auto (triton on a GPU where the head size fits its kernels)"
    )
    enable_prefix_grouping: bool = _knob(
        True, "group a job's prompts by shared prefix and compute each prefix once"
    )
    enable_cascade_attention: bool = _knob(
        True, "a group's prefix is read once per step for all of its requests"
    )
    cascade_decode_kernel: str = _knob(
        "auto", "one-pass, two-pass or auto (one-pass for Triton on a GPU)"
    )
    cascade_prefill_kernel: str = _knob(
        "auto", "fused, two-pass or auto (fused for Triton on a GPU)"
    )
    async_scheduling: bool = _knob(
        True, "schedule and enqueue each step while the one before it still runs"
    )
    structured_outputs_jump_forward: bool = _knob(
        True, "append the tokens a grammar forces without a step each"
    )
    tokenizer: str | None = _knob(None, "the tokenizer's directory; unset: the model's")
    skip_tokenizer_init: bool = _knob(
        False, "load no tokenizer: prompts come as token ids, outputs carry ids only"
    )

    def __post_init__(self) -> None:
        if self.quantization == "":  # an empty variable or flag: none
            object.__setattr__(self, "quantization", None)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r} is invalid: expected {DEVICES_HELP}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(
                f"quantization={self.quantization!r} is not supported: pass 'fp8' (W8A8, e4m3) "
                "or leave it out"
            )
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "num_scheduler_steps",
            "tensor_parallel_size",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} is invalid: expected >= 1")
        if not math.isfinite(self.gpu_memory_utilization):
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} is invalid: expected a "
                "fraction between 0.05 and 0.99"
            )

    def replace(self, **changes: Any) -> EngineSettings:
        """A copy with `changes`; an unknown name is a TypeError naming it."""
        return engine_settings(**{**self.as_kwargs(), **changes})

    def as_kwargs(self) -> dict[str, Any]:
        """The settings as `LLM(...)` keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def engine_settings(**kwargs: Any) -> EngineSettings:
    """EngineSettings from keyword arguments; an unknown one is a TypeError that names it."""
    known = EngineSettings.__dataclass_fields__
    unknown = sorted(name for name in kwargs if name not in known)
    if unknown:
        raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
    return EngineSettings(**kwargs)
