"""Builds the model on its device, of the class the registry names for its architecture: weights
from local safetensors or a GGUF file, or random for the random presets."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors import safe_open

from prefixgrove.catalog import gguf
from prefixgrove.catalog.presets import gguf_path, is_preset

from ..parallel.group import TensorParallel
from .arch import ModelArch
from .base import CausalLM
from .fp8_block_linear import GROUP, SCALE_SUFFIX
from .fp8_linear import dequantize_checkpoint, quantize_model
from .ops import ModelOps
from .registry import model_class
from .sharding import Cut, block_cut

# A checkpoint tensor's name -> the cut this rank takes of it and its whole length, or None: whole
CutOf = Callable[[str], "tuple[Cut, int] | None"]


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
    parallel: TensorParallel | None = None,
    fp8_block_scales: bool = False,
) -> CausalLM:
    """The model of `model`, or this rank's shard of it under tensor parallelism: each rank reads
    only its part of each checkpoint tensor. `fp8_block_scales`: FP8 layers take 128x128 block
    scales (a block-scaled checkpoint's, or made at load)."""
    cls = model_class(arch.architecture)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: no fp32 copy of an 8B model
    try:
        with torch.device(device):
            net = cls(arch, max_positions, ops, parallel)
    finally:
        torch.set_default_dtype(default_dtype)
    cut_of = _with_block_scales(net.checkpoint_cut) if net.parallel.size > 1 else None
    scales: dict[str, torch.Tensor] = {}
    input_scales: dict[str, torch.Tensor] = {}
    if is_preset(model):
        init_random_weights(net, seed)
    elif (path := gguf_path(model)) is not None:
        net.load_weights(gguf.iter_tensors(path, device, cut_of))
    elif quantization == "fp8":
        # e4m3 tensors of a compressed-tensors checkpoint come in dequantized, their scales kept
        # so that quantize_model stores the very same e4m3 values again.
        tensors = iter_safetensors(model, device, cut_of)
        net.load_weights(dequantize_checkpoint(tensors, dtype, scales, input_scales))
    else:
        net.load_weights(iter_safetensors(model, device, cut_of))
    if quantization == "fp8":
        # Quantized at load time: from the checkpoint's scales where it has them, else per output
        # channel from its weights (vLLM's quantization="fp8").
        fused, statics = _fused_scales(scales, input_scales, net)
        quantize_model(net, fused, statics, block_scales=fp8_block_scales)
    return net.eval().requires_grad_(False)


def _with_block_scales(cut_of: CutOf) -> CutOf:
    """`cut_of` that also cuts a weight's block scales (`weight_scale_inv`): the blocks of the
    rank's slice of the weight, refused where that slice does not keep them whole."""

    def cut(name: str) -> tuple[Cut, int] | None:
        if not name.endswith(SCALE_SUFFIX):
            return cut_of(name)
        found = cut_of(name.removesuffix(SCALE_SUFFIX) + ".weight")
        return None if found is None else block_cut(name, *found, GROUP)

    return cut


def _fused_scales(
    scales: dict[str, torch.Tensor], input_scales: dict[str, torch.Tensor], net: CausalLM
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Checkpoint scales by Hugging Face name -> by the model's parameter name, the shards of a fused
    matrix (q, k, v; gate, up) concatenated in the order they sit in it."""
    shards: dict[str, dict[str, torch.Tensor]] = {}
    statics: dict[str, list[torch.Tensor]] = {}
    for hf_name, scale in scales.items():
        target = net.map_checkpoint_name(hf_name)
        if target is None:
            continue
        name, shard = target
        shards.setdefault(name, {})[shard] = scale
        if hf_name in input_scales:
            statics.setdefault(name, []).append(input_scales[hf_name])
    fused = {}
    for name, parts in shards.items():
        order = net.shards_of(name)
        if set(parts) != set(order):
            raise ValueError(f"{name}: the checkpoint quantizes shards {sorted(parts)} of {order}")
        fused[name] = torch.cat([parts[s] for s in order])
    # a fused layer takes one static activation scale: the largest of its shards', so none clips
    return fused, {name: torch.stack(v).max() for name, v in statics.items()}


@torch.no_grad()
def init_random_weights(net: CausalLM, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights, generated on the model's own device (seconds for 8B on a GPU).
    A sharded parameter is drawn whole and cut, so every rank count gets the same model."""
    device = next(net.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in net.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        elif (layout := net.layout(name)) is not None and net.parallel.size > 1:
            whole = p.new_empty(layout.full_shape(p.shape)).normal_(0.0, std, generator=gen)
            p.copy_(layout.local_of_full(whole))
        else:
            p.normal_(0.0, std, generator=gen)


def iter_safetensors(
    model_dir: str, device: str, cut_of: CutOf | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) over one or sharded safetensors files of a Hugging Face directory;
    with `cut_of`, only this rank's slice of each tensor it cuts is read from the file."""
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
                found = cut_of(key) if cut_of is not None else None
                if found is None:
                    yield key, f.get_tensor(key)
                else:
                    yield key, _read_slice(f.get_slice(key), *found)


def _read_slice(lazy: Any, cut: Cut, full_len: int) -> torch.Tensor:
    """This rank's slice of a tensor still in its file, zero-padded as `Cut.take` pads it."""
    shape = lazy.get_shape()
    if not cut.applies_to(tuple(shape), full_len):
        return lazy[:]  # type: ignore[no-any-return]
    start, length = cut.bounds(full_len)
    index = [slice(None)] * len(shape)
    index[cut.dim] = slice(start, start + length)
    return cut.pad(lazy[tuple(index)], full_len)
