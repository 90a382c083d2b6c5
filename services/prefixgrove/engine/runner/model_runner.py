"""Runs the model for a scheduled batch: inputs in with one copy, tokens out with one copy per step.

Decode-only batches replay CUDA graphs and may run a window of several steps without a CPU round trip: the
sampled tokens are written straight into the next step's inputs on the device, positions, sequence lengths
and cache slots advance there too, and each step's tokens stream back on a side stream while the GPU goes on.
What it launched whose tokens the host has not seen yet (a step, or a window) is `in_flight.py`'s.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator

import numpy as np
import torch

from ..attention.backend import ForwardContext, create_backend
from ..attention.kv_cache import LayerCache, allocate, cache_torch_dtype
from ..config import EngineConfig
from ..core.sequence import ScheduledSeq, Sequence
from ..device import to_device
from ..models.arch import ModelArch
from ..models.loader import load_model
from ..models.ops import create_ops
from ..models.sharding import local_arch
from ..parallel.group import TensorParallel
from ..parallel.leader import FollowerLink
from ..sampling.prompt_logprobs import (
    PromptSpan,
    logit_row_slices,
    prompt_spans,
    record_prompt_logprobs,
)
from ..sampling.sampler import Sampler, SamplingBatch
from ..structured.masks import StepMasker, TokenMask
from . import kv_sizing
from .cuda_graphs import DecodeGraphs
from .in_flight import DecodeWindow, InFlight, PendingStep, StepResult
from .input_builder import InputBuilder, StepInputs
from .step_timeline import StepTimeline, recorded_event

logger = logging.getLogger(__name__)


class ModelRunner:
    """One rank's model, KV cache and decode graphs. Under tensor parallelism rank 0's runner also
    schedules the others: each step's shape goes to them through `link` and its inputs follow in
    one broadcast of the arena, then every rank runs the same forward pass on its shard; rank 0
    alone samples (parallel/follower.py runs the other side)."""

    def __init__(self, config: EngineConfig, parallel: TensorParallel | None = None) -> None:
        self.config = config
        self.parallel = parallel or TensorParallel.single()
        self.link: FollowerLink | None = None  # rank 0 of several: the followers' command pipes
        self.device = torch.device(self.parallel.device_of(config.device))
        arch, s = config.model.arch, config.scheduler
        # A decode window may run a few tokens past a request's end before the CPU sees it stop.
        self.max_positions = config.model.max_model_len + s.num_scheduler_steps
        cuda = self.device.type == "cuda"
        self.memory_baseline = torch.cuda.memory_allocated(self.device) if cuda else 0
        self.model = load_model(
            config.model.model,
            arch,
            dtype=config.model.dtype,
            device=str(self.device),
            max_positions=self.max_positions,
            seed=config.model.seed,
            ops=create_ops(config.attention_backend),
            quantization=config.model.quantization,
            parallel=self.parallel,
            fp8_block_scales=config.model.fp8_block_scales,
        )
        self.backend = create_backend(
            config.attention_backend,
            one_pass_decode=config.cascade_decode_kernel == "one-pass",
            fuse_suffix_chunks=config.cascade_prefill_kernel == "fused",
        )
        self.builder = InputBuilder(
            block_size=config.cache.block_size,
            device=self.device,
            use_cascade=config.enable_cascade_attention,
            max_tokens=s.max_num_batched_tokens,
            max_seqs=s.max_num_seqs,
            max_blocks_per_seq=-(-self.max_positions // config.cache.block_size),
        )
        self.sampler = Sampler(arch.vocab_size, self.device)
        self.masker = StepMasker(self.device, jump_forward=s.jump_forward)
        self.timeline = StepTimeline()  # the device's idle time between steps, for benchmarks
        self.kv_caches: list[tuple[LayerCache, LayerCache]] = []
        self.graphs: DecodeGraphs | None = None
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None

    # -- memory -----------------------------------------------------------------------------------------

    @property
    def local_arch(self) -> ModelArch:
        """This rank's shapes: its KV heads are what its cache holds."""
        return local_arch(self.config.model.arch, self.parallel.size)

    @property
    def bytes_per_block(self) -> int:
        a, c = self.local_arch, self.config.cache
        dtype = cache_torch_dtype(c.kv_cache_dtype, self.config.model.dtype)
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * a.num_layers * c.block_size * a.num_kv_heads * a.head_dim * elem

    def num_blocks_to_allocate(self) -> int:
        return kv_sizing.blocks_to_allocate(self)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.send("allocate", num_blocks)
        self.allocate_local(num_blocks)

    def allocate_local(self, num_blocks: int) -> None:
        """This rank's cache alone (the followers are told by `allocate_kv_cache`)."""
        a, c = self.local_arch, self.config.cache
        shape = (num_blocks, c.block_size, a.num_kv_heads, a.head_dim)
        self.kv_caches = allocate(
            a.num_layers, shape, self.config.model.dtype, c.kv_cache_dtype, self.device
        )

    def send(self, op: str, *args: object) -> None:
        """Rank 0: tells the followers what to do next (nothing without followers)."""
        if self.link is not None:
            self.link.send(op, *args)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        self.send("capture")
        self.graphs = DecodeGraphs(
            self.builder,
            self._logits,
            self.config.scheduler.max_num_seqs,
            cascade=self.config.enable_cascade_attention,
        )
        self.graphs.capture()

    def release_graphs(self) -> None:
        """Frees the decode graphs before a tensor-parallel group is torn down: NCCL's teardown
        waits until every graph that captured one of its collectives is destroyed (pytorch#115388),
        so with them alive `destroy_process_group` never returns."""
        self.graphs = None
        gc.collect()  # the CUDAGraph objects go now, not whenever a cycle is collected
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- steps ------------------------------------------------------------------------------------------

    def hidden_states(self, inputs: StepInputs) -> torch.Tensor:
        """The model's last hidden states of the step (of its sampled rows where it narrows)."""
        ctx = ForwardContext(self.kv_caches, inputs.metadata, self.backend, inputs.sampled)
        return self.model(inputs.input_ids, inputs.positions, ctx)

    def _logits(
        self,
        inputs: StepInputs,
        out: torch.Tensor | None = None,
        prompt: list[PromptSpan] | None = None,
    ) -> torch.Tensor:
        hidden = self.hidden_states(inputs)
        if inputs.sampled is None:  # every row was computed to the end
            if prompt:
                record_prompt_logprobs(prompt, hidden, self.model.compute_logits)
            hidden = hidden[inputs.logits_indices]
        return self.model.compute_logits(hidden, out)

    def _forward(
        self, batch: list[ScheduledSeq], feed: InFlight | None = None
    ) -> tuple[StepInputs, torch.Tensor]:
        order, groups = self.builder.plan(batch)
        decode = all(item.num_tokens == 1 and item.sample for item in order)
        if decode and self.graphs is not None and self.graphs.padded_size(len(order)):
            graphs = self.graphs
            return graphs.run(order, groups, lambda inputs: self._ready(inputs, feed, graphs))
        inputs = self.builder.fill(order, groups)
        prompt = prompt_spans(order)
        if prompt:
            inputs.sampled = None  # rows scoring prompt tokens need the last layer too
        self._ready(inputs, feed, prompt=prompt)
        return inputs, self._logits(inputs, prompt=prompt)

    def _ready(
        self,
        inputs: StepInputs,
        feed: InFlight | None,
        graphs: DecodeGraphs | None = None,
        prompt: list[PromptSpan] | None = None,
    ) -> None:
        """The step's inputs complete on the device (tokens still in flight fed in), and under
        tensor parallelism on every rank: what to run goes to the followers (the step's shape, the
        graph it replays, the prompt rows it scores), then its inputs in one broadcast of the arena."""
        if feed is not None:
            self._feed_pending(inputs, feed)
        if self.link is None:
            return
        shape = inputs.shape if inputs.sampled is not None else inputs.shape.unnarrowed()
        graph = graphs.last_key if graphs is not None else None
        self.link.send("step", shape, graph, logit_row_slices(prompt or []))
        self.parallel.broadcast(self.builder.arena.device)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> StepResult:
        """One step; returns the batch in row order and one host row per sampling sequence."""
        return self.result(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: list[ScheduledSeq], feed: InFlight | None = None) -> PendingStep:
        """Enqueues one step without waiting for its tokens. `feed` is the step (or window) enqueued
        before it whose tokens the host has not seen: the ids this step's rows need of them (each such
        row's last token) are copied on the device."""
        first = self.timeline.begin(self.device)
        inputs, logits = self._forward(batch, feed)
        sampling = [item.seq for item in inputs.order if item.sample]
        if not sampling:
            self.timeline.end("step", first, len(inputs.order), len(inputs.input_ids))
            return PendingStep(inputs.order, None, None, None, {})
        params = SamplingBatch.build(sampling, self.device, self.config.model.arch.vocab_size)
        packed = self.sampler(logits, params, mask=self._masks(sampling, feed))
        host, done = self._copy_to_host(packed)
        self.timeline.end("step", first, len(inputs.order), len(inputs.input_ids))
        rows = {seq.seq_id: i for i, seq in enumerate(sampling)}
        return PendingStep(inputs.order, host, done, packed[:, 0], rows)

    def result(self, step: PendingStep) -> StepResult:
        """Waits for a launched step's tokens: its batch in row order, one host row per sampling one."""
        if step.host is None:
            return step.order, np.empty((0, 1), dtype=np.float32)
        return step.order, self._wait(step.host, step.done)

    def _feed_pending(self, inputs: StepInputs, feed: InFlight) -> None:
        """Writes the ids of the tokens `feed` sampled last, which the host has not seen (a sequence's
        last token, pending), into this step's input ids, on the device and in stream order."""
        dst, src, offset = [], [], 0
        for item in inputs.order:
            seq, start = item.seq, item.seq.num_computed_tokens
            last = seq.num_tokens - 1
            if seq.num_pending_tokens and start <= last < start + item.num_tokens:
                dst.append(offset + last - start)
                src.append(feed.sampled_rows[seq.seq_id])
            offset += item.num_tokens
        if not dst:
            return
        assert feed.tokens is not None  # a sequence with a pending token was sampled by `feed`
        index = to_device(np.array([dst, src], dtype=np.int64), self.device)
        ids = inputs.input_ids
        ids.index_copy_(0, index[0], feed.tokens.index_select(0, index[1]).to(ids.dtype))

    @torch.inference_mode()
    def start_window(
        self, batch: list[ScheduledSeq], steps: int, feed: InFlight | None = None
    ) -> DecodeWindow:
        """Enqueues `steps` decode steps of a decode-only batch whose blocks for them are reserved; the
        tokens come back through `window_results` while later steps still run. `feed` as in `launch`."""
        first = self.timeline.begin(self.device)
        inputs, logits = self._forward(batch, feed)
        if steps > 1:
            self.send("window", steps - 1, len(inputs.order))
        seqs = [item.seq for item in inputs.order]
        params = SamplingBatch.build(seqs, self.device, self.config.model.arch.vocab_size, steps)
        window = self._run_steps(inputs, logits, params, steps, feed)
        self.timeline.end("window", first, len(inputs.order), steps)
        return window

    def _run_steps(
        self,
        inputs: StepInputs,
        logits: torch.Tensor,
        params: SamplingBatch,
        steps: int,
        feed: InFlight | None,
    ) -> DecodeWindow:
        n = len(inputs.order)
        seqs = [item.seq for item in inputs.order]
        constrained = any(seq.grammar is not None for seq in seqs)
        copies: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        tokens = logits.new_empty(0)
        for j in range(steps):
            if j:
                logits = self._replay_next(inputs, n)
            # A constrained row's mask needs the window's earlier tokens: waiting for them here
            # leaves the GPU on this step's forward pass, enqueued just above.
            mask = self._masks(seqs, feed, copies) if constrained else None
            packed = self.sampler(logits, params, step=j, mask=mask)
            copies.append(self._copy_to_host(packed))  # streams back while the next steps run
            tokens = packed[:, 0]
            if j + 1 < steps:
                if self.link is not None:  # the followers advance their inputs by them too
                    tokens = self.parallel.broadcast(tokens.contiguous())
                self.advance_inputs(inputs, tokens, n)
        return DecodeWindow(inputs, copies, tokens)

    def _masks(
        self,
        seqs: list[Sequence],
        feed: InFlight | None,
        window: list[tuple[torch.Tensor, torch.cuda.Event | None]] | None = None,
    ) -> TokenMask | None:
        """Token masks of the constrained rows among `seqs` (a step's sampling rows in order), whose
        tokens before this step are the host's, those `feed` sampled (pending), then this window's
        (one row per seq in each of `window`'s host copies)."""
        states = [seq.grammar for seq in seqs]
        if not any(states):
            return None
        window = window or []
        produced = [seq.num_generated + len(window) for seq in seqs]
        # host rows of the step in flight (pending tokens) and of this window's earlier steps, each
        # waited for once, when a matcher first needs them
        fed: list[np.ndarray] = []
        hosts: list[np.ndarray] = []
        stats = self.masker.stats

        def tokens_from(r: int, start: int) -> list[int]:
            seq = seqs[r]
            out = seq.output_token_ids
            waited = time.perf_counter()
            if seq.num_pending_tokens and not fed:
                fed.extend(self._feed_hosts(feed))
            if window and not hosts:
                hosts.extend(self._wait(host, done) for host, done in window)
            stats.wait_seconds += time.perf_counter() - waited
            later = []
            if seq.num_pending_tokens:
                assert feed is not None
                row = feed.sampled_rows[seq.seq_id]
                later = [int(h[row, 0]) for h in fed]
            later += [int(h[r, 0]) for h in hosts]
            return out[start:] + later[max(0, start - len(out)) :]

        forward_done = self._event() if stats.measure_idle else None
        mask = self.masker.masks(states, tokens_from, produced)
        if forward_done is not None:
            pair = (forward_done, self._event())
            stats.idle_events.append(pair)  # type: ignore[arg-type]
            self.timeline.mask_wait(pair)  # type: ignore[arg-type]
        for r in mask.ends if mask is not None else ():
            # Its grammar is complete: the request ends with the EOS this step samples. Known now,
            # its slot goes back as soon as the step is enqueued (as for a request at max_tokens),
            # not a window later when the host sees the EOS.
            seqs[r].max_tokens = min(seqs[r].max_tokens, produced[r] + 1)
        return mask

    def _event(self) -> torch.cuda.Event | None:
        return recorded_event() if self.device.type == "cuda" else None

    def _feed_hosts(self, feed: InFlight | None) -> list[np.ndarray]:
        """The host rows of the step (or each step of the window) in flight, once they landed."""
        assert feed is not None, "a sequence with pending tokens was sampled by the step in flight"
        if isinstance(feed, DecodeWindow):
            return [self._wait(host, done) for host, done in feed.copies]
        assert feed.host is not None
        return [self._wait(feed.host, feed.done)]

    def window_results(self, window: DecodeWindow) -> Iterator[StepResult]:
        """Each step's batch order and host rows, as the step's copy lands."""
        for host, done in window.copies:
            yield window.inputs.order, self._wait(host, done)

    def advance_inputs(self, inputs: StepInputs, tokens: torch.Tensor, n: int) -> None:
        """Turns this step's sampled tokens into the next step's inputs, on the device."""
        meta, bs = inputs.metadata, self.config.cache.block_size
        inputs.input_ids[:n].copy_(tokens)
        inputs.positions[:n] += 1
        meta.seq_lens[:n] += 1
        pos = inputs.positions[:n].long()
        rows = torch.arange(n, device=pos.device)
        meta.slot_mapping[:n].copy_(meta.block_tables[rows, pos // bs] * bs + pos % bs)

    def _replay_next(self, inputs: StepInputs, n: int) -> torch.Tensor:
        if self.graphs is not None and self.graphs.padded_size(n):
            return self.graphs.replay_last()[:n]
        return self._logits(inputs)

    def _copy_to_host(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A step's one device-to-host copy, on a side stream into pinned memory."""
        if self._copy_stream is None:
            return packed, None
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            host.copy_(packed, non_blocking=True)
            packed.record_stream(self._copy_stream)
            done = torch.cuda.Event()
            done.record()
        return host, done

    def _wait(self, host: torch.Tensor, done: torch.cuda.Event | None) -> np.ndarray:
        if done is not None:
            self.masker.build_ahead(done.query)  # grammar matchers, in time spent waiting anyway
            done.synchronize()
        return host.numpy()
