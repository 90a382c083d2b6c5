"""Work on the device whose sampled tokens the host has not seen yet: one launched step, or a decode
window of several, and the rows they hand back."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ..core.sequence import ScheduledSeq
from .input_builder import StepInputs

StepResult = tuple[
    list[ScheduledSeq], np.ndarray
]  # rows in batch order, one host row per sampled seq


@dataclass
class DecodeWindow:
    """Decode steps enqueued on the device for one batch, their tokens still on their way back."""

    inputs: StepInputs  # the arena views the steps run on (advanced on the device step by step)
    copies: list[tuple[torch.Tensor, torch.cuda.Event | None]]  # per step: host rows, copy done
    # [num_rows] the last step's tokens, on the device: what a step enqueued behind the window takes
    # as its rows' last tokens (as PendingStep.tokens)
    tokens: torch.Tensor

    @cached_property
    def sampled_rows(self) -> dict[int, int]:
        """seq_id -> its row (every row samples); built once, read once per row of the next step."""
        return {item.seq.seq_id: i for i, item in enumerate(self.inputs.order)}


@dataclass
class PendingStep:
    """One step on the device whose sampled tokens are still on their way back to the host."""

    order: list[ScheduledSeq]  # the batch in row order
    host: torch.Tensor | None  # host rows, one per sampling sequence (None: nothing sampled)
    done: torch.cuda.Event | None  # the copy into `host` has landed
    tokens: torch.Tensor | None  # [num_sampled] the sampled ids on the device (as floats)
    sampled_rows: dict[int, int]  # seq_id -> its row among the sampled ones


# A step or a window on the device whose sampled tokens the host has not seen yet.
InFlight = PendingStep | DecodeWindow
