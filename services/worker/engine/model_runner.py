"""Runs the model for a scheduled batch: inputs in with one copy, tokens out with one copy."""

from __future__ import annotations

import logging

import numpy as np
import torch

from .attention.backend import ForwardContext, create_backend
from .config import EngineConfig
from .input_builder import InputBuilder
from .models.loader import load_model
from .sampler import Sampler, SamplingBatch
from .scheduler import ScheduledSeq

logger = logging.getLogger(__name__)

_CPU_DEFAULT_CACHE_TOKENS = 65536


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        arch = config.model.arch
        self.model = load_model(config.model.model, arch, dtype=config.model.dtype, device=config.device,
                                max_positions=config.model.max_model_len, seed=config.model.seed)
        self.backend = create_backend(config.attention_backend)
        self.builder = InputBuilder(config.cache.block_size, self.device,
                                    use_cascade=config.enable_cascade_attention)
        self.sampler = Sampler(arch.vocab_size, self.device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def bytes_per_block(self) -> int:
        a, c = self.config.model.arch, self.config.cache
        elem = torch.empty((), dtype=self.config.model.dtype).element_size()
        return 2 * a.num_layers * c.block_size * a.num_kv_heads * a.head_dim * elem

    def num_blocks_to_allocate(self) -> int:
        c = self.config.cache
        if c.num_blocks is not None:
            return c.num_blocks
        if self.device.type != "cuda":
            s = self.config.scheduler
            tokens = min(s.max_num_seqs * self.config.model.max_model_len, _CPU_DEFAULT_CACHE_TOKENS)
            return -(-tokens // c.block_size) + 1
        return self._profile_num_blocks()

    @torch.inference_mode()
    def _profile_num_blocks(self) -> int:
        """Runs the largest step the scheduler may issue, then gives what memory is left to the cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = self.config.scheduler.max_num_batched_tokens
        self.allocate_kv_cache(-(-tokens // self.config.cache.block_size) + 1)
        from .sequence import Sequence
        from .sampling_params import SamplingParams

        seqs = min(self.config.scheduler.max_num_seqs, tokens)
        per_seq = tokens // seqs
        dummy = []
        for i in range(seqs):
            seq = Sequence(i, f"profile-{i}", [0] * per_seq, SamplingParams(max_tokens=1), 0)
            seq.block_table = list(range(1, 1 + -(-per_seq // self.config.cache.block_size)))
            dummy.append(ScheduledSeq(seq, per_seq, sample=True))
        self.execute(dummy)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_allocated(self.device)
        budget = total * self.config.cache.gpu_memory_utilization - peak - used_by_others
        num_blocks = int(budget // self.bytes_per_block)
        if num_blocks < 2:
            raise RuntimeError(f"no memory left for the KV cache: peak {peak / 2**30:.1f} GiB of "
                               f"{total / 2**30:.1f} GiB at gpu_memory_utilization="
                               f"{self.config.cache.gpu_memory_utilization}")
        logger.info("KV cache: %d blocks (%.1f GiB); profiling peak %.1f GiB", num_blocks,
                    num_blocks * self.bytes_per_block / 2**30, peak / 2**30)
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        a, c = self.config.model.arch, self.config.cache
        shape = (num_blocks, c.block_size, a.num_kv_heads, a.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.config.model.dtype, device=self.device),
             torch.zeros(shape, dtype=self.config.model.dtype, device=self.device))
            for _ in range(a.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], np.ndarray]:
        """Returns the batch in row order and one host row per sampling sequence, in that order."""
        inputs = self.builder.build(batch)
        ctx = ForwardContext(self.kv_caches, inputs.metadata, self.backend)
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        sampling = [item.seq for item in inputs.order if item.sample]
        if not sampling:
            return inputs.order, np.empty((0, 1), dtype=np.float32)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        params = SamplingBatch.build(sampling, self.device, self.config.model.arch.vocab_size)
        return inputs.order, self._to_host(self.sampler(logits, params))

    def _to_host(self, packed: torch.Tensor) -> np.ndarray:
        """The step's one device-to-host copy, on a side stream into pinned memory."""
        if self._copy_stream is None:
            return packed.numpy()
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            host.copy_(packed, non_blocking=True)
            packed.record_stream(self._copy_stream)
            done = torch.cuda.Event()
            done.record()
        done.synchronize()
        return host.numpy()
