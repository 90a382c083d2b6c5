"""How many KV blocks a runner allocates: a set number, a fixed CPU default, or on a GPU what its
memory holds after the largest step the scheduler may issue. Under tensor parallelism every rank
profiles its own device in the same step and all take the fewest blocks any rank can hold."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ..core.sequence import ScheduledSeq, Sequence
from ..sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from .model_runner import ModelRunner

logger = logging.getLogger(__name__)

_CPU_DEFAULT_CACHE_TOKENS = 65536
_GRAPH_HEADROOM = 2 << 30  # bytes left free for CUDA graphs' pool and allocator slack


def blocks_to_allocate(runner: ModelRunner) -> int:
    c = runner.config.cache
    if c.num_blocks is not None:
        return c.num_blocks
    if runner.device.type != "cuda":
        s = runner.config.scheduler
        tokens = min(s.max_num_seqs * runner.config.model.max_model_len, _CPU_DEFAULT_CACHE_TOKENS)
        return -(-tokens // c.block_size) + 1
    return _profile(runner)


def _tokens_per_profile_seq(runner: ModelRunner) -> tuple[int, int]:
    s = runner.config.scheduler
    seqs = min(s.max_num_seqs, s.max_num_batched_tokens)
    return seqs, s.max_num_batched_tokens // seqs


@torch.inference_mode()
def _profile(runner: ModelRunner) -> int:
    """Rank 0: runs the largest step the scheduler may issue (the followers run it beside it),
    then gives what memory is left to the cache."""
    runner.send("profile_begin")
    begin_profile(runner)
    seqs, per_seq = _tokens_per_profile_seq(runner)
    bs = runner.config.cache.block_size
    dummy = []
    for i in range(seqs):
        seq = Sequence(i, f"profile-{i}", [0] * per_seq, SamplingParams(max_tokens=1), 0)
        seq.block_table = list(range(1, 1 + -(-per_seq // bs)))
        dummy.append(ScheduledSeq(seq, per_seq, sample=True))
    runner.execute(dummy)
    runner.send("profile_end")
    return blocks_after_profile(runner)


def begin_profile(runner: ModelRunner) -> None:
    """Before the profiling step: a clean peak and a cache just large enough for it."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(runner.device)
    _, per_seq = _tokens_per_profile_seq(runner)
    runner.allocate_local(-(-per_seq // runner.config.cache.block_size) + 1)


def blocks_after_profile(runner: ModelRunner) -> int:
    """The KV blocks this rank's memory holds after the profiling step; under tensor parallelism
    the least of every rank's (each calls this at the same point)."""
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device)
    runner.kv_caches = []
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    cache = runner.config.cache
    # This engine may use its share of the device (gpu_memory_utilization, vLLM's meaning) minus its
    # own peak; memory others hold (other engines in this process, other processes) is not ours to
    # count, but the cache must still fit in what is free, with room for the decode graphs.
    own_peak = peak - runner.memory_baseline
    budget = min(total * cache.gpu_memory_utilization - own_peak, free - _GRAPH_HEADROOM)
    num_blocks = runner.parallel.min_over_ranks(
        int(budget // runner.bytes_per_block), runner.device
    )
    if num_blocks < 2:
        raise RuntimeError(
            f"no memory left for the KV cache: peak {peak / 2**30:.1f} GiB of "
            f"{total / 2**30:.1f} GiB at gpu_memory_utilization={cache.gpu_memory_utilization}"
        )
    logger.info(
        "KV cache: %d blocks (%.1f GiB) per rank; profiling peak %.1f GiB",
        num_blocks,
        num_blocks * runner.bytes_per_block / 2**30,
        peak / 2**30,
    )
    return num_blocks
