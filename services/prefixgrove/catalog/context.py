"""How long a model's context may be: one rule, read from its Hugging Face config, for the planner's
request checks and for the engine."""

from __future__ import annotations

from typing import Any


def sliding_window(hf_config: Any) -> int | None:
    """The attention window the model declares and uses (Mistral and Phi-3 unless told otherwise;
    Qwen2 and Qwen3 only with use_sliding_window), or None."""
    arch = (getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"])[0]
    windowed = arch in ("MistralForCausalLM", "Phi3ForCausalLM")
    if not getattr(hf_config, "use_sliding_window", windowed):
        return None
    return getattr(hf_config, "sliding_window", None)


def context_limit(hf_config: Any, requested: int | None = None) -> int:
    """The most tokens (prompt and output) one request may hold: the model's positions, capped at
    its sliding window (attention here is full, which equals the model's only within the window),
    and at `requested` (a max_model_len) where one is given."""
    limit = int(hf_config.max_position_embeddings)
    window = sliding_window(hf_config)
    if window:
        limit = min(limit, int(window))
    return min(requested, limit) if requested else limit


def engine_context(hf_config: Any, requested: int | None, on_gpu: bool) -> int:
    """The context an engine gives a request: `requested` (a max_model_len), else the model's
    limit capped at 8192 tokens on a GPU and 2048 on the CPU (a KV cache that holds a batch of
    such requests); ValueError when `requested` exceeds the model's limit."""
    limit = context_limit(hf_config)
    if requested is None:
        return min(limit, 8192 if on_gpu else 2048)
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds what the model supports ({limit})")
    return requested
