"""The weights of a GGUF file under their Hugging Face names, tensor by tensor and dequantized to
float32, so that a model never sits in memory twice.

llama.cpp's converter stores some weights otherwise than Hugging Face checkpoints do, and each is
put back as transformers' own GGUF reader puts it back:
- the q/k rows of the `llama` architecture are interleaved per head for its rotary layout (the
  other architectures keep Hugging Face's order, and transformers unpermutes `llama` files alone);
- Phi-3's q/k/v are one `attn_qkv` and its gate/up one `ffn_up` (gate first);
- a mixture of experts stacks each layer's experts in one tensor per projection, [experts, width,
  hidden] for gate and up and [experts, hidden, width] for down (numpy's order);
- Qwen2-MoE's shared-expert gate is a vector, where Hugging Face has a [1, hidden] matrix;
- Gemma's norm weights are stored as the 1 + w its norms multiply by (w is put back, the model adds
  the one again as it does for Hugging Face checkpoints), and its `ffn_norm` is the norm before the
  feed-forward block, one of its four norms a layer.

A fused or stacked tensor is a run of row ranges, one per Hugging Face tensor (a quantized matrix
stores each row as its own run of blocks), so each is read as a tensor of its own: under tensor
parallelism a rank dequantizes only its rows of each, or its columns where they start and end on a
quantization block.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# llama.cpp tensor names -> Hugging Face names ({} is the layer index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma's names where they differ: four norms a layer, `ffn_norm` the one before the MLP
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA = ("gemma2", "gemma3")
# stacked experts -> each expert's projection
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

# A Hugging Face tensor's name -> the cut this rank takes of it and its whole length, or None
CutOf = Callable[[str], Any]


@dataclass(frozen=True)
class Part:
    """One Hugging Face tensor inside a GGUF tensor: rows [first_row, first_row + its rows) of the
    GGUF tensor seen as a matrix [rows, last dimension] (a vector's elements are its rows)."""

    name: str
    kind: str  # llama.cpp's name of the tensor ("attn_q"), or the global name
    first_row: int
    shape: tuple[int, ...]  # numpy order: [out_features, in_features] for a matrix

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else self.shape[0]


def iter_tensors(
    path: str, device: str | torch.device, cut_of: CutOf | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (Hugging Face name, float32 tensor on `device`) for every weight of a GGUF file of a
    family `gguf.check_family` accepts. With `cut_of` (engine/models/sharding.py) a tensor cut by
    rows is dequantized for this rank's rows only, one cut by block-aligned columns for those
    columns only; any other cut is taken after."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    heads = _field(reader, arch, "attention.head_count")
    kv_heads = _field(reader, arch, "attention.head_count_kv") or heads
    for tensor in reader.tensors:
        # numpy shape is the reverse of GGUF's dims: [out_features, in_features] for a matrix
        shape = tuple(reversed([int(d) for d in tensor.shape]))
        for part in parts_of(tensor.name, shape, arch, heads, kv_heads):
            found = cut_of(part.name) if cut_of is not None else None
            cut = None  # (dim, start, length) of this rank's slice, read from the file alone
            if found is not None and found[0].applies_to(part.shape, found[1]):
                cut = (found[0].dim, *found[0].bounds(found[1]))
            array, read = _dequantized(tensor, shape, part, cut)
            # llama.cpp's q/k row order is per head: a cut of whole heads unpermutes on its own
            if arch == "llama" and part.kind in ("attn_q", "attn_k"):
                total = heads if part.kind == "attn_q" else kv_heads
                array = _unpermute(array, total * array.shape[0] // part.shape[0])
            if part.kind == "ffn_gate_inp_shexp":
                array = array.reshape(1, -1)
            if arch in _GEMMA and part.name.endswith("norm.weight"):
                array = array - 1.0  # as transformers' reader: the model adds the one back
            # NOTE: a tensor the file maps without quantization comes back read-only: copy it
            if not (array.flags.writeable and array.flags.c_contiguous):
                array = np.array(array, order="C")
            out = torch.from_numpy(array)
            if found is not None:
                out = found[0].pad(out, found[1]) if read else found[0].take(out)
            yield part.name, out.to(device)


def parts_of(
    gguf_name: str, shape: tuple[int, ...], arch: str, heads: int, kv_heads: int
) -> list[Part]:
    """The Hugging Face tensors a GGUF tensor holds; ValueError for one with no place in `arch`."""
    if gguf_name in _GLOBAL_NAMES:
        return [Part(_GLOBAL_NAMES[gguf_name], gguf_name, 0, shape)]
    match = _LAYER.match(gguf_name)
    if match is None:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a {arch!r} model")
    layer, kind, param = match.groups()
    prefix = f"model.layers.{layer}."
    if kind in _EXPERTS:
        experts, rows, columns = shape
        return [
            Part(
                f"{prefix}mlp.experts.{e}.{_EXPERTS[kind]}.{param}", kind, e * rows, (rows, columns)
            )
            for e in range(experts)
        ]
    if kind == "attn_qkv" or (arch == "phi3" and kind == "ffn_up"):
        return _split_rows(prefix, kind, param, shape, heads, kv_heads)
    names = _GEMMA_LAYER_NAMES if arch in _GEMMA else _LAYER_NAMES
    if kind not in names:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a {arch!r} model")
    return [Part(f"{prefix}{names[kind]}.{param}", kind, 0, shape)]


def _split_rows(
    prefix: str, kind: str, param: str, shape: tuple[int, ...], heads: int, kv_heads: int
) -> list[Part]:
    """Phi-3's fused q/k/v (rows of heads, KV heads, KV heads) and gate/up (two halves)."""
    names: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    sizes = [shape[0] // 2] * 2
    if kind == "attn_qkv":
        head_dim = shape[0] // (heads + 2 * kv_heads)
        names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    if sum(sizes) != shape[0]:
        raise ValueError(
            f"GGUF tensor {kind!r} of {prefix.rstrip('.')} has {shape[0]} rows, expected "
            f"{' + '.join(map(str, sizes))}"
        )
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    return [
        Part(f"{prefix}{name}.{param}", kind, start, (size, *shape[1:]))
        for name, start, size in zip(names, starts, sizes, strict=True)
    ]


def _dequantized(
    tensor: Any, shape: tuple[int, ...], part: Part, cut: tuple[int, int, int] | None
) -> tuple[np.ndarray, bool]:
    """float32 [part.shape] of a GGUF tensor's part, or only `cut` of it (dim, start, length), and
    whether only the cut was read: rows are runs of the file's units (bytes of blocks, or values of
    an unquantized tensor), and columns are too where they start and end on a block boundary."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    data = tensor.data.reshape(int(np.prod(shape[:-1])) if len(shape) > 1 else shape[0], -1)
    data, out_shape = data[part.first_row : part.first_row + part.rows], part.shape
    if cut is not None:
        dim, start, length = cut
        block = GGML_QUANT_SIZES[tensor.tensor_type][0]
        per_block = data.shape[1] * block // out_shape[-1]  # the file's units per block
        if dim == 0:
            data, out_shape = data[start : start + length], (length, *out_shape[1:])
        elif dim == 1 and len(out_shape) == 2 and start % block == 0 and length % block == 0:
            first, size = start // block * per_block, length // block * per_block
            data, out_shape = data[:, first : first + size], (out_shape[0], length)
        else:
            cut = None
    array = dequantize(np.ascontiguousarray(data), tensor.tensor_type)
    return array.astype(np.float32, copy=False).reshape(out_shape), cut is not None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row order: per head it stores the two rotary halves interleaved
    ([h, d/2, 2] rows), Hugging Face keeps them as two blocks ([h, 2, d/2])."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, arch: str, key: str) -> int:
    field = reader.fields.get(f"{arch}.{key}")
    return int(field.contents()) if field is not None else 0
