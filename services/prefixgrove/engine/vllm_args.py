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
    "trust_remote_code": (False, True),  # no remote code runs: only the registry's families load
    "tokenizer_mode": ("auto",),
    "load_format": ("auto",),
    "revision": (None,),
    "tokenizer_revision": (None,),
    "download_dir": (None,),
    "cpu_offload_gb": (0,),
    "enable_chunked_prefill": (None, True),  # prefill is always chunked
    "enable_lora": (False,),
    # one engine generates and embeds: vLLM's choice of what a model runs for changes nothing
    "task": ("auto", "generate", "embed"),
    "runner": ("auto", "generate", "pooling"),
    "convert": ("auto", "none", "embed"),
}
_WHY = {
    "pipeline_parallel_size": "one engine splits a model by tensor_parallel_size only",
    "trust_remote_code": "only the registry's own model code runs",
    "tokenizer_mode": "the tokenizer is the one transformers' AutoTokenizer loads",
    "load_format": "safetensors and GGUF are found by the model path",
    "revision": "nothing is downloaded: pass a local path",
    "tokenizer_revision": "nothing is downloaded: pass a local path",
    "download_dir": "nothing is downloaded: pass a local path",
    "cpu_offload_gb": "weights stay on the device",
    "enable_chunked_prefill": "prefill is always chunked",
    "enable_lora": "LoRA adapters are not supported",
    "task": "only generation and embeddings are served",
    "runner": "only generation and embeddings are served",
    "convert": "only generation and embeddings are served",
}
# Accepted and without effect here: they tune what vLLM does and prefixgrove does not.
IGNORED = frozenset({"swap_space", "disable_log_stats", "max_seq_len_to_capture"})


# vLLM's methods of `LLM` that prefixgrove's does not have, and what each would have done.
UNSUPPORTED_METHODS = {
    "beam_search": "beam search",
    "encode": "vLLM's generic pooling: use embed",
    "classify": "classification models",
    "score": "cross-encoder and embedding scoring",
    "reward": "reward models",
}
SUPPORTED_METHODS = (
    "generate, chat, embed, get_default_sampling_params, get_tokenizer, reset_prefix_cache"
)


def unsupported_method(name: str) -> NotImplementedError:
    """The error a call of one of UNSUPPORTED_METHODS raises, naming what is there instead."""
    return NotImplementedError(
        f"LLM.{name} is not supported ({UNSUPPORTED_METHODS[name]} is not served); prefixgrove's "
        f"LLM offers {SUPPORTED_METHODS} (docs/engine-api.md lists what of vLLM's API is there)"
    )


def check_request_options(lora_request: Any, priority: Any, count: int) -> None:
    """vLLM's per-call `lora_request` and `priority`, taken where they ask for what is done here
    anyway: no adapter, and every request at the same priority (vLLM's default first-come policy
    refuses any other value too)."""
    if lora_request is not None:
        raise ValueError(
            f"lora_request={lora_request!r} is not supported (LoRA adapters are not): leave it "
            "out or pass None"
        )
    if priority is None:
        return
    if len(priority) != count or any(p != 0 for p in priority):
        raise ValueError(
            f"priority={list(priority)[:8]!r} is not supported: requests run in input order "
            f"(grouped by shared prefix); leave it out, or pass {count} zeros"
        )


def engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The engine's keyword arguments for vLLM-style `kwargs`; ValueError names a refused one.
    seed=None (vLLM's default since 0.11) is the engine's own seed: it is deterministic anyway."""
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name == "seed" and value is None:
            continue
        if name in _ONLY:
            if value not in _ONLY[name]:
                allowed = " or ".join(repr(v) for v in _ONLY[name])
                raise ValueError(
                    f"{name}={value!r} is not supported ({_WHY[name]}): leave it out or pass {allowed}"
                )
        elif name not in IGNORED:
            out[name] = value
    return out
