"""The batch limits an engine takes when none are given: the engine's best measured settings for the
device it finds (benchmarks/HISTORY.md, "Batch limits and engine options"), so that `LLM(model)`,
`prefixgrove run`, a worker and the benchmarks run alike with defaults.

A large GPU (the H100/H200 class) takes the larger batch and prefill step: past a few hundred
requests a decode step's matmuls turn compute-bound, yet the larger batch still moves more requests
per second, and the larger step keeps the prefill matmuls near their ceiling. A GPU with less memory
keeps the smaller limits: its KV cache would not hold the larger batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Devices at least this large (total memory) take the large batch: the H100/H200 class.
_LARGE_GPU_BYTES = 60 << 30


@dataclass(frozen=True)
class BatchLimits:
    max_num_seqs: int
    max_num_batched_tokens: int


LARGE_GPU = BatchLimits(max_num_seqs=512, max_num_batched_tokens=16384)
SMALL_GPU = BatchLimits(max_num_seqs=256, max_num_batched_tokens=8192)
CPU = BatchLimits(max_num_seqs=256, max_num_batched_tokens=2048)


def best_batch_limits(device: str) -> BatchLimits:
    """The limits for `device` ("cpu", "cuda", "cuda:N" or "auto")."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not device.startswith("cuda"):
        return CPU
    if not torch.cuda.is_available():  # a config made where it will not run: no size to read
        return SMALL_GPU
    index = torch.device(device).index
    total = torch.cuda.get_device_properties(
        torch.cuda.current_device() if index is None else index
    )
    return LARGE_GPU if total.total_memory >= _LARGE_GPU_BYTES else SMALL_GPU
