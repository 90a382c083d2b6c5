"""Engine configuration: frozen dataclasses, validated on construction, derived values as properties."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from prefixgrove.catalog.context import engine_context
from prefixgrove.catalog.presets import load_hf_config
from prefixgrove.engine_settings import EngineSettings, engine_settings

from .attention.kv_cache import FP8_KV_DTYPE, cache_torch_dtype, check_kv_cache_dtype
from .batch_defaults import best_batch_limits
from .models.arch import ModelArch, architecture_of
from .models.fp8_linear import (
    check_quantization,
    checkpoint_block_scales,
    checkpoint_quantization,
)
from .models.registry import model_class
from .models.sharding import check_tensor_parallel

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a local Hugging Face directory or a built-in preset name
    arch: ModelArch
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    # None (weights in `dtype`) or "fp8": W8A8 linear layers (models/fp8_linear.py)
    quantization: str | None = None
    # with "fp8": 128x128 weight blocks, activations per 128 columns (models/fp8_block_linear.py)
    fp8_block_scales: bool = False

    def __post_init__(self) -> None:
        check_quantization(self.quantization)
        if self.fp8_block_scales and self.quantization != "fp8":
            raise ValueError(
                f"fp8_block_scales=True needs quantization='fp8', not {self.quantization!r}"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len}: must be at least 2")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None  # explicit size; otherwise measured from free device memory
    # "auto": keys and values in the model's dtype; "fp8" (or "fp8_e4m3"): float8_e4m3fn with a
    # scale per layer for K and for V, half the bytes of bf16 (attention/kv_cache.py)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.block_size < 8 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size}: must be a power of two >= 8")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization}: "
                "expected a fraction between 0.05 and 0.99"
            )
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks}: must be at least 2")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_scheduler_steps: int = 1  # decode steps per CPU round trip when a batch is decode-only
    first_wave: int = 4  # suffixes of a new group that must fit beside its prefix to admit it
    # Each step or decode window is scheduled and enqueued while the one before it still runs, before
    # the host has seen that one's tokens (they reach the new step's inputs on the device), so the GPU
    # does not wait for the host's scheduling, input filling and token handling between steps.
    async_scheduling: bool = True
    # Where a request's grammar allows exactly one token, that token is what its step would sample: it
    # is appended without the step, and the next step computes the run of such tokens as one chunk
    # (the output is the same token for token; structured outputs without logprobs only).
    jump_forward: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps", "first_wave"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    attention_backend: str = "torch"
    enable_prefix_grouping: bool = True
    # Full KV blocks outlive their requests, found again by content (vLLM's automatic prefix caching)
    enable_prefix_caching: bool = True
    enable_cascade_attention: bool = True
    # How decode steps run cascade attention: "one-pass" (kernels/cascade_decode.py: a group's prefix and
    # its requests' own keys in one stream) or "two-pass" (prefix pass, then a suffix pass that merges,
    # as prefill chunks do). `create` picks one pass for Triton on CUDA, where its decode windows are
    # shorter (benchmarks/RESULTS.md), and two passes elsewhere: there every row then takes the same
    # arithmetic whether its step is decode-only or mixed, so a CPU run's tokens and logprobs do not
    # depend on how requests were batched (a local run equals a distributed one, bit for bit).
    cascade_decode_kernel: str = "two-pass"
    # How prefill steps run the cascade for suffix chunks (a grouped request's prompt rows):
    # "fused" (the prefix pass goes on to each chunk's own keys and writes its output; only decode
    # rows and ungrouped sequences take the suffix pass) or "two-pass" (every grouped row's prefix
    # state written, read back and merged by the suffix pass). `create` picks "fused" for Triton on
    # CUDA and "two-pass" elsewhere, for the same bit-for-bit reason as above (a prompt's last token
    # alone in a step is a one-row chunk, which takes two passes).
    cascade_prefill_kernel: str = "two-pass"
    enforce_eager: bool = False
    # Ranks of one engine, one process and one device each (engine/parallel/): the model's heads,
    # columns and vocabulary are split over them
    tensor_parallel_size: int = 1
    # The ranks' all-reduces always through NCCL, never over peer memory (parallel/peer_allreduce.py)
    disable_custom_all_reduce: bool = False
    tokenizer: str | None = None
    # No tokenizer is loaded: prompts come as token ids and outputs carry ids only (vLLM's option)
    skip_tokenizer_init: bool = False

    def __post_init__(self) -> None:
        if self.cascade_decode_kernel not in ("two-pass", "one-pass"):
            raise ValueError(
                f"cascade_decode_kernel={self.cascade_decode_kernel!r}: expected 'two-pass' or "
                "'one-pass'"
            )
        if self.cascade_prefill_kernel not in ("two-pass", "fused"):
            raise ValueError(
                f"cascade_prefill_kernel={self.cascade_prefill_kernel!r}: expected 'two-pass' or "
                "'fused'"
            )
        if self.attention_backend not in ("triton", "torch"):
            raise ValueError(
                f"attention_backend={self.attention_backend!r}: expected 'triton' or 'torch'"
            )
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r}: expected 'cpu', 'cuda' or 'cuda:N'")
        head_dim = self.model.arch.head_dim
        if self.attention_backend == "triton" and not kernels_take(head_dim):
            raise ValueError(
                f"head_dim={head_dim} of {self.model.model} does not fit the Triton kernels (a power "
                "of two from 32 to 256): use attention_backend='torch' (what 'auto' picks for it)"
            )
        if (
            self.attention_backend == "triton"
            and not self.is_cuda
            and os.environ.get("TRITON_INTERPRET") != "1"
        ):
            raise ValueError(
                "attention_backend='triton' on the CPU runs only under Triton's interpreter: "
                "set TRITON_INTERPRET=1, or use attention_backend='torch'"
            )
        if (
            self.attention_backend == "triton"
            and self.is_cuda
            and cache_torch_dtype(self.cache.kv_cache_dtype, self.model.dtype) == FP8_KV_DTYPE
            and torch.cuda.is_available()
            and torch.cuda.get_device_capability(self.device) < (8, 9)
        ):
            raise ValueError(
                f"kv_cache_dtype={self.cache.kv_cache_dtype!r} on the Triton kernels needs a GPU "
                "of compute capability 8.9 or newer (Ada, Hopper: FP8 conversions); use "
                "kv_cache_dtype='auto'"
            )
        check_tensor_parallel(self.model.arch, self.tensor_parallel_size)
        if self.is_cuda and self.tensor_parallel_size > 1 and torch.cuda.is_available():
            first = int(self.device.split(":")[1]) if ":" in self.device else 0
            if first + self.tensor_parallel_size > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size={self.tensor_parallel_size} from {self.device} needs "
                    f"{first + self.tensor_parallel_size} GPUs; this machine shows "
                    f"{torch.cuda.device_count()}"
                )
        if self.scheduler.max_num_batched_tokens < self.scheduler.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.scheduler.max_num_batched_tokens} is below "
                f"max_num_seqs={self.scheduler.max_num_seqs}: every running request needs a token"
            )

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @classmethod
    def create(cls, model: str, **kwargs: Any) -> EngineConfig:
        """A config from vLLM-style keyword arguments (EngineSettings' fields); an unknown one is a
        TypeError that names it."""
        return cls.from_settings(model, engine_settings(**kwargs))

    @classmethod
    def from_settings(cls, model: str, settings: EngineSettings) -> EngineConfig:
        """The config `settings` give for `model`, each 'auto' and unset knob resolved for the
        device: what `LLM(...)`, `prefixgrove run`, a worker and the benchmarks all run."""
        s = settings
        device = _resolve_device(s.device)
        cuda = device.startswith("cuda")
        model_cfg = _model_config(
            model, s.dtype, s.max_model_len, s.seed, cuda, s.quantization, s.fp8_block_scales
        )
        backend = s.attention_backend
        if backend == "auto":
            backend = "triton" if cuda and kernels_take(model_cfg.arch.head_dim) else "torch"
        decode_kernel, prefill_kernel = _cascade_kernels(
            cuda and backend == "triton", s.cascade_decode_kernel, s.cascade_prefill_kernel
        )
        return cls(
            model=model_cfg,
            cache=CacheConfig(
                s.block_size,
                s.gpu_memory_utilization,
                s.num_gpu_blocks_override,
                kv_cache_dtype=s.kv_cache_dtype,
            ),
            scheduler=_scheduler_config(s, device),
            device=device,
            attention_backend=backend,
            enable_prefix_grouping=s.enable_prefix_grouping,
            enable_prefix_caching=s.enable_prefix_caching,
            enable_cascade_attention=s.enable_cascade_attention,
            cascade_decode_kernel=decode_kernel,
            cascade_prefill_kernel=prefill_kernel,
            # the torch references synchronise: no CUDA graphs
            enforce_eager=s.enforce_eager or not cuda or backend == "torch",
            tensor_parallel_size=s.tensor_parallel_size or 1,
            disable_custom_all_reduce=s.disable_custom_all_reduce,
            tokenizer=s.tokenizer,
            skip_tokenizer_init=s.skip_tokenizer_init,
        )


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _scheduler_config(s: EngineSettings, device: str) -> SchedulerConfig:
    """Batch limits and decode windows: what the user set, else the best measured for the device."""
    best = best_batch_limits(device)
    max_num_seqs = s.max_num_seqs or best.max_num_seqs
    batched = s.max_num_batched_tokens or max(best.max_num_batched_tokens, max_num_seqs)
    steps = s.num_scheduler_steps or (8 if device.startswith("cuda") else 1)
    return SchedulerConfig(
        max_num_seqs,
        batched,
        steps,
        async_scheduling=s.async_scheduling,
        jump_forward=s.structured_outputs_jump_forward,
    )


def _model_config(
    model: str,
    dtype: str | torch.dtype,
    max_model_len: int | None,
    seed: int,
    cuda: bool,
    quantization: str | None = None,
    fp8_block_scales: bool = False,
) -> ModelConfig:
    hf_config = load_hf_config(model)
    model_class(architecture_of(hf_config))  # refuses an unsupported architecture, naming it
    arch = ModelArch.from_hf_config(hf_config)
    try:
        max_model_len = engine_context(hf_config, max_model_len, cuda)
    except ValueError as exc:
        raise ValueError(f"{model}: {exc}") from None
    # An FP8 checkpoint (compressed-tensors) runs as FP8 without being asked; None keeps it so.
    stored = checkpoint_quantization(hf_config)
    if stored is not None and quantization not in (None, stored):
        raise ValueError(f"quantization={quantization!r}: {model} is stored as {stored}")
    quantization = quantization or stored
    return ModelConfig(
        model=model,
        arch=arch,
        dtype=_resolve_dtype(dtype, hf_config, cuda),
        max_model_len=max_model_len,
        seed=seed,
        quantization=quantization,
        fp8_block_scales=_block_scales(model, hf_config, fp8_block_scales),
    )


def _block_scales(model: str, hf_config: Any, asked: bool) -> bool:
    """Whether FP8 layers take block scales: a block-scaled checkpoint's own, or asked for on
    an unquantized one; a checkpoint stored with other FP8 scales is not re-cut into blocks."""
    if checkpoint_block_scales(hf_config):
        return True
    if asked and checkpoint_quantization(hf_config) is not None:
        raise ValueError(
            f"fp8_block_scales=True: {model} is stored in FP8 with per-tensor or per-channel "
            "scales, which cannot be cut into blocks; leave fp8_block_scales off for it"
        )
    return asked


def _cascade_kernels(gpu_kernels: bool, decode: str, prefill: str) -> tuple[str, str]:
    """The cascade's decode and prefill forms: one pass and fused chunks for Triton on CUDA, two
    passes elsewhere (see EngineConfig.cascade_decode_kernel)."""
    if decode == "auto":
        decode = "one-pass" if gpu_kernels else "two-pass"
    if prefill == "auto":
        prefill = "fused" if gpu_kernels else "two-pass"
    return decode, prefill


def _resolve_dtype(dtype: str | torch.dtype, hf_config: Any, cuda: bool) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if not cuda:
            return torch.float32
        declared = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
        declared = str(declared).removeprefix("torch.") if declared else "bfloat16"
        return _DTYPES.get(declared, torch.bfloat16) if declared != "float32" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is unknown; expected auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def kernels_take(head_dim: int) -> bool:
    """Whether the Triton kernels run this head size (their tiles are powers of two). Other sizes
    (Phi-3-mini's 96, say) run on the torch backend: exact, slower, no CUDA graphs."""
    return not head_dim & (head_dim - 1) and 32 <= head_dim <= 256
