"""Tiny random GGUF files, written with the gguf package in the layout llama.cpp's converter gives
them: its tensor names (gguf's own name map), q/k rows interleaved per head for the `llama`
architecture only, each layer's experts stacked in one tensor per projection ([experts, width,
hidden] for gate and up, [experts, hidden, width] for down), Gemma's norm weights as 1 + w and no
output tensor where the embeddings are tied, a byte-level vocabulary in the metadata.

Weights are F32, or Q8_0 where a row is a whole number of blocks (`quantized=True`), so that a
tensor-parallel rank's block-aligned column cut reads real quantized bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import (
    MODEL_ARCH_NAMES,
    GGMLQuantizationType,
    GGUFWriter,
    RopeScalingType,
    TokenType,
    get_tensor_name_map,
)
from gguf.quants import quantize
from transformers import PreTrainedModel

from prefixgrove.catalog.byte_tokenizer import BOS_ID, EOS_ID, SPECIAL_TOKENS, _byte_to_unicode

Q8_0_BLOCK = 32


def write_gguf(
    model: PreTrainedModel,
    path: Path,
    gguf_arch: str,
    quantized: bool = False,
    extra: dict[str, np.ndarray] | None = None,
) -> str:
    """Writes `model` (a transformers model in fp32) as a GGUF file of architecture `gguf_arch`,
    with `extra` tensors (by GGUF name) after the model's."""
    writer = GGUFWriter(str(path), gguf_arch)
    _write_hparams(writer, model.config, gguf_arch)
    _write_tokenizer(writer)
    for name, array in [*_gguf_tensors(model, gguf_arch), *(extra or {}).items()]:
        if quantized and array.ndim > 1 and array.shape[-1] % Q8_0_BLOCK == 0:
            writer.add_tensor(
                name,
                quantize(array, GGMLQuantizationType.Q8_0),
                raw_dtype=GGMLQuantizationType.Q8_0,
            )
        else:
            writer.add_tensor(name, array)
    return _finish(writer, path)


def write_metadata(config: Any, path: Path, gguf_arch: str, fields: dict[str, Any]) -> str:
    """A GGUF file of `config`'s metadata, `fields` (full key -> str, float or int) after it, and no
    tensors: all that reading its config takes."""
    writer = GGUFWriter(str(path), gguf_arch)
    _write_hparams(writer, config, gguf_arch)
    _write_tokenizer(writer)
    for key, value in fields.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    return _finish(writer, path)


def _finish(writer: GGUFWriter, path: Path) -> str:
    """Writes out what `writer` was given, in GGUF's order, and closes the file at `path`."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _write_hparams(writer: GGUFWriter, config: Any, gguf_arch: str) -> None:
    """The metadata llama.cpp's converter writes for the families tested here."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_name(f"tiny-random-{gguf_arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if gguf_arch in ("gemma2", "gemma3"):
        _write_gemma_hparams(writer, config, gguf_arch)
    else:
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        writer.add_expert_feed_forward_length(width)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _write_gemma_hparams(writer: GGUFWriter, config: Any, gguf_arch: str) -> None:
    """As llama.cpp's converter: Gemma 2's soft-caps and no rotary base (its default, 10000);
    Gemma 3's global layers' base and linear scaling (its local base is llama.cpp's constant)."""
    writer.add_sliding_window(config.sliding_window)
    if gguf_arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        return
    rope = config.rope_parameters["full_attention"]
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])


def _write_tokenizer(writer: GGUFWriter) -> None:
    """The byte tokenizer as a GPT-2-style vocabulary: 256 byte tokens, then the special ones."""
    tokens = [_byte_to_unicode()[b] for b in range(256)] + list(SPECIAL_TOKENS)
    types = [TokenType.NORMAL] * 256 + [TokenType.CONTROL] * len(SPECIAL_TOKENS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(EOS_ID)  # else Phi-3's config default (32000) lies past the vocabulary


def _gguf_tensors(model: PreTrainedModel, gguf_arch: str) -> Iterator[tuple[str, np.ndarray]]:
    config = model.config
    arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == gguf_arch)
    names = get_tensor_name_map(arch, config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    for hf_name, tensor in _unstacked(model.state_dict()):
        if tied and hf_name == "lm_head.weight":
            continue  # the converter writes no output tensor for tied embeddings
        base, _, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, suffix = hf_name, "weight"
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        array = tensor.detach().float().numpy()
        if gguf_arch == "llama" and gguf_name.endswith(("attn_q", "attn_k")):
            kv = config.num_key_value_heads
            array = _permute(array, config.num_attention_heads if "attn_q" in gguf_name else kv)
        if gguf_arch in ("gemma2", "gemma3") and gguf_name.endswith("norm"):
            array = array + 1.0  # llama.cpp stores the 1 + w that Gemma's norms multiply by
        if gguf_name.endswith("ffn_gate_inp_shexp"):
            array = array.reshape(-1)  # llama.cpp stores the shared expert's gate as a vector
        yield f"{gguf_name}.{suffix}", np.ascontiguousarray(array)


def _unstacked(state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers 5's fused [experts, 2 * width, hidden] gate|up as the gate and up stacks the
    converter writes; everything else as it is."""
    for name, tensor in state.items():
        if name.endswith(".experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            stem = name.removesuffix("gate_up_proj")
            yield f"{stem}gate_proj", gate
            yield f"{stem}up_proj", up
        elif not name.endswith("rotary_emb.inv_freq"):
            yield name, tensor


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, the two rotary halves interleaved."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )
