"""What every model family's class provides: the loader, the FP8 quantizer and the runner reach a
model through these names alone, so a family is one module and one registry line (`registry.py`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..parallel.group import TensorParallel
from .arch import ModelArch
from .ops import ModelOps
from .sharding import Cut, ParamLayout

if TYPE_CHECKING:
    from ..attention.backend import ForwardContext


class CausalLM(nn.Module, ABC):
    """A decoder over a flat batch of tokens, built from (arch, max_positions, ops, parallel).

    The rules a family keeps:
    - Parameters are created in the dtype and on the device that are current when it is built (the
      loader sets both), and named as `map_checkpoint_name` names them.
    - `layers` holds the decoder layers in order: FP8 quantization replaces every
      `RowInvariantLinear` inside them by an `Fp8Linear` and leaves the rest (embedding, lm_head)
      in the model's dtype; `fuse_fp8_inputs` then runs once.
    - `forward` writes every layer's keys and values of every token into `ctx`'s paged cache and
      returns the hidden states of `ctx.sampled`'s rows only, when it names some; `compute_logits`
      turns them into logits. Both run inside CUDA graphs: no host synchronisation in them.
    - Under tensor parallelism (`parallel.size` > 1) each rank builds its shard of every layer, and
      `layout` says how each parameter is cut (sharding.py): the loader reads only that part of each
      checkpoint tensor, random weights take it from the whole tensor, so every rank count computes
      the same model. The collectives are the layers' own; every rank calls them in the same order.
    """

    arch: ModelArch
    layers: nn.ModuleList

    def __init__(
        self,
        arch: ModelArch,
        max_positions: int,
        ops: ModelOps,
        parallel: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.parallel = parallel or TensorParallel.single()
        self.build(max_positions, ops)

    @abstractmethod
    def build(self, max_positions: int, ops: ModelOps) -> None:
        """Creates the family's layers and buffers for `self.arch` (run once, by `__init__`)."""

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens or num_sampled, hidden]."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [rows, vocab]; into `out` when given (the decode graphs' shared buffer)."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies (Hugging Face name, tensor) pairs in; ValueError for a tensor with no place, a
        wrong shape, or a parameter left unfilled."""

    @abstractmethod
    def map_checkpoint_name(self, hf_name: str) -> tuple[str, str] | None:
        """A checkpoint tensor's name -> (the parameter it fills, the shard of it: '' for all of
        it), or None for a tensor the model does not use."""

    @abstractmethod
    def shards_of(self, name: str) -> tuple[str, ...]:
        """The shards of parameter `name` in the order they are stacked in it (('',): unfused)."""

    def layout(self, name: str) -> ParamLayout | None:
        """How this rank holds parameter `name`; None (the default): whole on every rank."""
        return None

    def checkpoint_cut(self, hf_name: str) -> tuple[Cut, int] | None:
        """The cut this rank takes of a checkpoint tensor and the tensor's whole length along the
        cut, or None where it holds the tensor whole."""
        target = self.map_checkpoint_name(hf_name)
        layout = None if target is None else self.layout(target[0])
        if layout is None or target is None:
            return None
        piece = layout.piece(target[1])
        return (piece.cut, piece.full_len) if piece.cut.parts > 1 else None

    def fuse_fp8_inputs(self) -> None:
        """Called once after FP8 quantization: lets the norms and activations before FP8 layers
        write their output already quantized. Optional: without it every layer quantizes its own
        input, to the same values."""
