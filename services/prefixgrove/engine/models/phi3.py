"""Phi-3 (Phi3ForCausalLM: Phi-3 and Phi-3.5 mini and medium): the Llama-family decoder, whose
checkpoints store q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (gate first).

Those fused tensors are split into the separate projections the Llama family loads, so the model,
its FP8 quantization and its tensor-parallel cuts are the Llama family's own. Under tensor
parallelism a rank reads a fused tensor whole and keeps its cut of each part. Phi-3-mini's head size
(96) runs on the torch attention backend (`config.kernels_take`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from .llama import LlamaForCausalLM
from .sharding import Cut

_FUSED_PARTS = {
    ".qkv_proj.": ("q_proj", "k_proj", "v_proj"),
    ".gate_up_proj.": ("gate_proj", "up_proj"),
}


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split_fused(weights))

    def checkpoint_cut(self, hf_name: str) -> tuple[Cut, int] | None:
        """A fused tensor is read whole: its parts are cut apart once split."""
        if any(fused in hf_name for fused in _FUSED_PARTS):
            return None
        return super().checkpoint_cut(hf_name)

    def _split_fused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        a = self.arch
        sizes = {
            ".qkv_proj.": [a.q_size, a.kv_size, a.kv_size],
            ".gate_up_proj.": [a.intermediate_size, a.intermediate_size],
        }
        for name, tensor in weights:
            fused = next((f for f in _FUSED_PARTS if f in name), None)
            if fused is None:
                yield name, tensor
                continue
            if tensor.shape[0] != sum(sizes[fused]):
                raise ValueError(
                    f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected "
                    f"{sum(sizes[fused])} ({' + '.join(map(str, sizes[fused]))})"
                )
            for part, piece in zip(_FUSED_PARTS[fused], tensor.split(sizes[fused]), strict=True):
                yield name.replace(fused, f".{part}."), piece
