"""The batch limits a serving process takes when none are given: the engine's best measured settings
for the device it finds (benchmarks/RESULTS.md), so that a deployment with defaults runs as the
benchmarks do.

On an H100 80GB the canonical job runs best at 512 requests per batch and 16,384 tokens per prefill
step (docs/performance.md): past ~256 requests a decode step's matmuls turn compute-bound, yet the
larger batch still moves more requests per second; the larger step keeps the matmuls near cuBLAS's
ceiling. A GPU with less memory keeps `LLM`'s defaults: its KV cache would not hold 512 requests.
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
    index = torch.device(device).index
    total = torch.cuda.get_device_properties(
        torch.cuda.current_device() if index is None else index
    )
    return LARGE_GPU if total.total_memory >= _LARGE_GPU_BYTES else SMALL_GPU
