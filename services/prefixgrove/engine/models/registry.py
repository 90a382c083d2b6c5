"""Which class builds a checkpoint's model: one table from the Hugging Face `architectures` name to
its family's `CausalLM`. Whatever asks whether an architecture is supported asks `model_class`.

A new family is its own module (the interface is `base.CausalLM`) and one line per architecture
here; docs/engine-api.md lists the same names (tests/engine/test_model_registry.py checks it).
"""

from __future__ import annotations

from collections.abc import Mapping

from .base import CausalLM
from .gemma import GemmaForCausalLM
from .llama import LlamaForCausalLM
from .moe import MoeForCausalLM
from .olmoe import OlmoeForCausalLM
from .phi3 import Phi3ForCausalLM

MODELS: Mapping[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}


def model_class(architecture: str) -> type[CausalLM]:
    """The class that builds `architecture`; ValueError naming it and the supported ones."""
    cls = MODELS.get(architecture)
    if cls is None:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(MODELS)}"
        )
    return cls
