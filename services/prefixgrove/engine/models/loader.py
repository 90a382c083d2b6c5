"""Builds the model on its device: weights from local safetensors or a GGUF file, or random for the
random presets."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from prefixgrove.catalog import gguf
from prefixgrove.catalog.presets import gguf_path, is_preset

from .arch import ModelArch
from .fp8_linear import quantize_model
from .llama import LlamaForCausalLM
from .ops import ModelOps


def load_model(
    model: str,
    arch: ModelArch,
    *,
    dtype: torch.dtype,
    device: str,
    max_positions: int,
    seed: int,
    ops: ModelOps,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: no fp32 copy of an 8B model
    try:
        with torch.device(device):
            net = LlamaForCausalLM(arch, max_positions, ops)
    finally:
        torch.set_default_dtype(default_dtype)
    if is_preset(model):
        init_random_weights(net, seed)
    elif (path := gguf_path(model)) is not None:
        net.load_weights(gguf.iter_tensors(path, device))
    else:
        net.load_weights(iter_safetensors(model, device))
    if quantization == "fp8":
        # Quantized at load time from the checkpoint's own weights (vLLM's quantization="fp8").
        quantize_model(net)
    return net.eval().requires_grad_(False)


@torch.no_grad()
def init_random_weights(net: LlamaForCausalLM, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights, generated on the model's own device (seconds for 8B on a GPU)."""
    device = next(net.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in net.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)


def iter_safetensors(model_dir: str, device: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) over one or sharded safetensors files of a Hugging Face directory."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(
            f"{model_dir} has no *.safetensors weights (other formats are not supported)"
        )
    for name in files:
        with safe_open(os.path.join(model_dir, name), framework="pt", device=device) as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield key, f.get_tensor(key)
