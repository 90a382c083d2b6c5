"""Shared pieces of the GPU benchmarks: the machine's name and ceilings, random workloads, JSON out."""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

import torch

# Ceilings measured on the lent H100 (see ../shared FACTS and benchmarks/RESULTS.md): dense bf16 matmul and
# device-to-device copy bandwidth (bytes read + written).
H100_BF16_FLOPS = 798e12
H100_HBM_BYTES_PER_S = 3.0e12


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def shared_prefix_prompts(
    groups: int, per_group: int, prefix_len: int, suffix_len: int, vocab: int, seed: int
) -> list[list[int]]:
    """The canonical BatchLLM workload: `groups` random prefixes, each followed by unique suffixes."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
        prompts += [
            prefix + [rng.randrange(vocab) for _ in range(suffix_len)] for _ in range(per_group)
        ]
    return prompts


def timed(fn: Any) -> tuple[Any, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)
    sys.stdout.flush()
