"""vLLM's `LLM(...)` keyword arguments, as a script ported by changing its import passes them.

Each is taken over where it means something here (EngineSettings' fields are vLLM's names), accepted where it
asks for what prefixgrove does anyway, and refused, by name, where it asks for something prefixgrove
does not do; a silent no-op would leave a user believing a setting took effect. The engine's knobs
(engine_settings.EngineSettings) pass through; `generation_config` and `override_generation_config` are `LLM`'s own (they set
its default sampling).
"""

from __future__ import annotations

from typing import Any

# Accepted when they hold one of these values (what prefixgrove does); refused otherwise.
_ONLY = {
    "pipeline_parallel_size": (1,),
    "trust_remote_code": (False,),
    "tokenizer_mode": ("auto",),
    "load_format": ("auto",),
    "revision": (None,),
    "tokenizer_revision": (None,),
    "download_dir": (None,),
    "cpu_offload_gb": (0,),
    "enable_chunked_prefill": (None, True),  # prefill is always chunked
    "enable_lora": (False,),
}
_WHY = {
    "pipeline_parallel_size": "one engine splits a model by tensor_parallel_size only",
    "trust_remote_code": "only the built-in Llama-family code runs",
    "tokenizer_mode": "the tokenizer is the one transformers' AutoTokenizer loads",
    "load_format": "safetensors and GGUF are found by the model path",
    "revision": "nothing is downloaded: pass a local path",
    "tokenizer_revision": "nothing is downloaded: pass a local path",
    "download_dir": "nothing is downloaded: pass a local path",
    "cpu_offload_gb": "weights stay on the device",
    "enable_chunked_prefill": "prefill is always chunked",
    "enable_lora": "LoRA adapters are not supported",
}
# Accepted and without effect here: they tune what vLLM does and prefixgrove does not.
IGNORED = frozenset(
    {"swap_space", "disable_log_stats", "max_seq_len_to_capture", "disable_custom_all_reduce"}
)


def engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The engine's keyword arguments for vLLM-style `kwargs`; ValueError names a refused one."""
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in _ONLY:
            if value not in _ONLY[name]:
                allowed = " or ".join(repr(v) for v in _ONLY[name])
                raise ValueError(
                    f"{name}={value!r} is not supported ({_WHY[name]}): leave it out or pass {allowed}"
                )
        elif name not in IGNORED:
            out[name] = value
    return out
