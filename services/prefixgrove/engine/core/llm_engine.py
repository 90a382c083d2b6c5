"""The engine loop: requests and groups in, one scheduled step at a time, finished requests out."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence as Seq
from functools import partial

from prefixgrove.catalog.generation import generation_eos_token_ids
from prefixgrove.catalog.presets import load_tokenizer
from prefixgrove.grouping import PrefixGroup

from ..config import EngineConfig
from ..runner.model_runner import DecodeWindow, InFlight, ModelRunner
from ..sampling.output_processor import OutputProcessor
from ..sampling.outputs import RequestOutput
from ..sampling.parallel_samples import SampleSets
from ..sampling.sampling_params import SamplingParams
from ..structured.grammars import GrammarCompiler
from ..structured.masks import GrammarState
from .block_manager import BlockManager
from .metrics import EngineMetrics
from .prompt_ids import checked_token_ids
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Group, ScheduledSeq, SeqStatus, Sequence

logger = logging.getLogger(__name__)
# A request as add_group takes it: (request_id, prompt_token_ids, params).
NewRequest = tuple[str, Seq[int], SamplingParams]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        arch = config.model.arch
        self.tokenizer = (
            None
            if config.skip_tokenizer_init
            else load_tokenizer(config.model.model, config.tokenizer)
        )
        self.runner = ModelRunner(config)
        num_blocks = self.runner.num_blocks_to_allocate()
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_graphs()
        self.blocks = BlockManager(num_blocks, config.cache.block_size)
        self.scheduler = Scheduler(
            config.scheduler, self.blocks, prefix_caching=config.enable_prefix_caching
        )
        self.output_processor = OutputProcessor(
            self.tokenizer,
            arch,
            config.model.max_model_len,
            generation_eos_token_ids(config.model.model),
        )
        self.grammars = GrammarCompiler(
            self.tokenizer, arch.vocab_size, self.output_processor.eos_token_ids
        )
        self.metrics = EngineMetrics()
        self._requests: dict[str, Sequence] = {}
        self._sample_sets = SampleSets()  # requests of n > 1 samples, answered once all are done
        self._seeds = random.Random(config.model.seed)
        self._next_id = 0
        # A step or window on the device whose tokens the host has not taken in yet (async scheduling),
        # and requests it finished outside a step (an abort waits for it), for the next step to return.
        # A request that finishes while a step in flight still computes a row for it gives its blocks
        # back at once: everything that could reuse them is enqueued behind that step.
        self._ahead: InFlight | None = None
        self._ready: list[RequestOutput] = []

    # -- intake -----------------------------------------------------------------------------------------

    def prepare(self, params: SamplingParams) -> SamplingParams:
        """The engine's own checked copy of `params` (they may have changed since they were made):
        ValueError naming the field; token ids are checked against the vocabulary."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        prepared = params.prepared(self.tokenizer, self.output_processor.eos_token_ids)
        vocab = self.config.model.arch.vocab_size
        for name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(prepared, name) or ()
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise ValueError(
                    f"SamplingParams.{name} names token id {outside[0]}, outside the "
                    f"vocabulary [0, {vocab})"
                )
        if prepared.structured_outputs is not None:  # a constraint that does not compile fails here
            self.grammars.compile(prepared.structured_outputs)
        return prepared

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> list[int]:
        """Raises ValueError naming the problem (nothing is queued); returns the ids as Python ints."""
        ids = checked_token_ids(prompt_token_ids, self.config.model.arch.vocab_size)
        if params.structured_outputs is not None:  # compiled once per constraint, then cached
            self.grammars.compile(params.structured_outputs)
        limit = self.config.model.max_model_len
        if params.truncate_prompt_tokens is not None:
            keep = limit if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            ids = ids[-keep:]
        if params.max_tokens is None and len(ids) >= limit:
            raise ValueError(
                f"prompt of {len(ids)} tokens leaves no room for output in max_model_len={limit}"
            )
        max_tokens = self._max_tokens(len(ids), params)
        if len(ids) + max_tokens > limit:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_tokens={params.max_tokens} "
                f"exceeds max_model_len={limit}"
            )
        need = self.blocks.blocks_for(len(ids) + max_tokens)
        if need > self.blocks.num_usable:
            raise ValueError(
                f"request needs {need} KV blocks but the cache holds {self.blocks.num_usable}"
            )
        return ids

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        prompt: str | None = None,
        *,
        validated: bool = False,
    ) -> None:
        """Queues one request; `params` become the engine's own checked copy (`prepare`) unless they
        are one already. validated: its ids are the list `validate` returned for these params
        (LLM.generate checks a whole job before queuing any of it), not checked or copied again.
        With params.n = k > 1 its k samples share the whole prompt as a group, and it is answered
        once, when all k finished (as `LLM.generate` answers it)."""
        if params.n > 1:
            group = PrefixGroup(len(prompt_token_ids), (0,))
            self.add_group(request_id, group, [(request_id, prompt_token_ids, params)],
                           validated=validated)  # fmt: skip
            return
        begin = time.perf_counter()
        try:
            params = params if params.is_prepared else self.prepare(params)
            ids = self._check_new(request_id, prompt_token_ids, params, validated)
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        self.scheduler.add(self._new_sequence(request_id, ids, params, prompt))
        self.metrics.intake_seconds += time.perf_counter() - begin

    def add_group(
        self,
        group_id: str,
        group: PrefixGroup,
        requests: Seq[NewRequest],
        *,
        validated: bool = False,
    ) -> None:
        """Adds `requests[i]` for each position i of the group; the prefix their prompts share is
        computed once for all.

        The prefix is cut to whole KV blocks and to leave every request at least one token of its own.
        If nothing worth sharing is left, or a request does not start with the prefix (the planner
        groups by block hashes), the requests run on their own. Every request is checked before any
        is queued (validated: as in `add_request`, their ids were checked already). A request of
        n > 1 samples takes part with all of them.
        """
        begin = time.perf_counter()
        members = self._check_group(group_id, group, requests, validated)
        # A request asking for prompt logprobs needs logits at every prompt position, which a shared
        # prefix never computes for it: it runs alone (vLLM's prefix cache skips such requests too).
        alone = [m for m in members if m[2].prompt_logprobs is not None]
        members = [m for m in members if m[2].prompt_logprobs is None]
        prefix_len = self._shared_prefix_len(group_id, group.prefix_len, members) if members else 0
        seqs = [self._new_sequence(rid, ids, params) for rid, ids, params in members + alone]
        if prefix_len:
            self.scheduler.add(self._group(group_id, prefix_len, seqs[: len(members)]))
            seqs = seqs[len(members) :]
        for seq in seqs:
            self.scheduler.add(seq)
        self.metrics.intake_seconds += time.perf_counter() - begin

    def _check_group(
        self, group_id: str, group: PrefixGroup, requests: Seq[NewRequest], validated: bool
    ) -> list[tuple[str, list[int], SamplingParams]]:
        if max(group.request_indices) >= len(requests):
            raise ValueError(
                f"group {group_id!r} names request {max(group.request_indices)}, but only "
                f"{len(requests)} requests came with it"
            )
        checked = []
        samples: list[tuple[str, int]] = []
        for rid, prompt, params in (requests[i] for i in group.request_indices):
            try:
                params = params if params.is_prepared else self.prepare(params)
                ids = self._check_new(rid, prompt, params, validated)
                for sample in self._sample_sets.expand(rid, ids, params)[1:]:
                    self._check_new(sample[0], ids, sample[2], validated=True)
            except ValueError as e:
                raise ValueError(f"request {rid!r} of group {group_id!r}: {e}") from None
            checked += self._sample_sets.expand(rid, ids, params)
            samples.append((rid, params.n))
        for rid, n in samples:  # only once every request of the group is accepted
            self._sample_sets.open(rid, n)
        return checked

    def _shared_prefix_len(
        self, group_id: str, prefix_len: int, members: list[tuple[str, list[int], SamplingParams]]
    ) -> int:
        """The prefix the members share in whole blocks, each keeping a token of its own; 0 where
        one of them does not start with the group's prefix."""
        bs = self.config.cache.block_size
        shortest = min(len(ids) for _, ids, _ in members)
        prefix_len = max(0, min(prefix_len, shortest - 1)) // bs * bs
        first = members[0][1][:prefix_len]
        for rid, ids, _ in members:
            if ids[:prefix_len] != first:
                logger.warning(
                    "request %r of group %r does not start with the group's %d-token prefix: its "
                    "%d requests run unshared",
                    rid,
                    group_id,
                    prefix_len,
                    len(members),
                )
                return 0
        return prefix_len

    def _group(self, group_id: str, prefix_len: int, members: list[Sequence]) -> Group:
        """The group's members and a prefill-only sequence of their shared prefix."""
        prefix_ids = members[0].prompt_token_ids[:prefix_len]
        prefix = Sequence(
            self._take_id(),
            f"{group_id}/prefix",
            prefix_ids,
            SamplingParams(max_tokens=1),
            0,
            is_prefix=True,
        )
        group = Group(group_id, prefix_len, prefix, members)
        prefix.group = group
        for m in members:
            m.group = group
        return group

    def _check_new(
        self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, validated: bool
    ) -> list[int]:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if validated:  # a list `validate` returned: the engine takes it over as it is
            return prompt_token_ids  # type: ignore[return-value]
        return self.validate(prompt_token_ids, params)

    def _new_sequence(
        self, request_id: str, ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> Sequence:
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        max_tokens = self._max_tokens(len(ids), params)
        seq = Sequence(self._take_id(), request_id, ids, params, seed, prompt, max_tokens)
        if params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs)
            eos = () if params.ignore_eos else self.output_processor.eos_token_ids
            seq.grammar = GrammarState(
                partial(self.grammars.matcher, grammar),
                frozenset(eos),
                self.grammars.tokenizer.vocab_size,
            )
            self.runner.masker.expect(seq.grammar)
        self._requests[request_id] = seq
        return seq

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """max_tokens, or where that is None all the context leaves after the prompt."""
        if params.max_tokens is not None:
            return params.max_tokens
        return self.config.model.max_model_len - prompt_len

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def abort(self, request_ids: Seq[str]) -> None:
        if self._ahead is not None:  # take its tokens in first; the aborted requests' are dropped
            ahead, self._ahead = self._ahead, None
            self._ready += self._finish_in_flight(ahead)
        samples = {sample for r in request_ids for sample in self._sample_sets.sample_ids(r)}
        for rid in samples:
            seq = self._requests.pop(rid, None)
            if seq is not None and not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
                if seq.grammar is not None:
                    seq.grammar.ended = True  # nothing is built or masked ahead for it any more
        for rid in request_ids:
            if len(self._sample_sets.sample_ids(rid)) > 1:  # none of its samples is answered
                self._ready = [out for out in self._ready if out.request_id not in samples]
                self._sample_sets.forget(rid)

    def reset_prefix_cache(self) -> None:
        """Forgets what the prefix cache holds (vLLM's reset_prefix_cache): the next requests start
        cold, as a benchmark's timed job must after a warm-up on its own prompts."""
        self.blocks.reset_cache()

    def has_unfinished_requests(self) -> bool:
        return self._ahead is not None or bool(self._ready) or self.scheduler.has_unfinished()

    # -- one step ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step, or a window of decode steps; returns the requests that finished.
        With async scheduling the step (or window) is enqueued behind the one before, whose tokens
        this call then takes in: a request finishes in the call after the one that ran its last step."""
        ready, self._ready = self._ready, []
        return self._sample_sets.collect(ready + self._step())

    def _step(self) -> list[RequestOutput]:
        begin = time.perf_counter()
        preemptions = self.scheduler.num_preemptions
        reused = self.scheduler.num_tokens_reused, self.scheduler.num_blocks_reused
        out = self.scheduler.schedule()
        now = time.time()
        for item in out.batch:
            item.seq.metrics.scheduled(now)
        self.metrics.preemptions = self.scheduler.num_preemptions
        # added, not assigned: a benchmark zeroes the metrics after its warm-up
        self.metrics.prefix_tokens_reused += self.scheduler.num_tokens_reused - reused[0]
        self.metrics.kv_blocks_shared += self.scheduler.num_blocks_reused - reused[1]
        preempted = self.scheduler.num_preemptions != preemptions
        ahead, self._ahead = self._ahead, None
        if out.batch and self._may_go_ahead(out, preempted):
            return self._launch_ahead(out, ahead, begin) + self._jump_forward(out)
        outputs: list[RequestOutput] = []
        if ahead is not None:
            waited = time.perf_counter()
            outputs = self._finish_in_flight(ahead)
            begin += time.perf_counter() - waited  # step time, not host time
        if outputs:  # the tokens just seen ended some of the batch scheduled beside them
            batch = [item for item in out.batch if item.seq.finish_reason is None]
            out = SchedulerOutput(batch)
        if not out.batch:
            self.metrics.host_seconds += time.perf_counter() - begin
            return outputs
        return outputs + self._run(out, self._window(out), begin) + self._jump_forward(out)

    def _run(self, out: SchedulerOutput, steps: int, begin: float) -> list[RequestOutput]:
        """Runs a batch (one step, or a window of decode steps) and waits for its tokens."""
        start = time.perf_counter()
        if steps == 1:
            results = iter([self.runner.execute(out.batch)])
        else:
            results = self.runner.window_results(self.runner.start_window(out.batch, steps))
        finished: list[Sequence] = []
        append_token = self.output_processor.append_token
        for order, rows in results:
            sampled = iter(rows)
            for item in order:
                row = next(sampled) if item.sample else None
                if item.seq.finish_reason is not None:
                    continue  # it stopped earlier in this window; its later tokens are dropped
                self._count(item)
                self.scheduler.complete_chunk(item)
                if row is not None and append_token(item.seq, row):
                    finished.append(item.seq)
        end = time.perf_counter()
        self._time_step(out, steps, end - start)
        outputs = self._finished(finished)
        self.metrics.host_seconds += time.perf_counter() - end + start - begin
        return outputs

    def _may_go_ahead(self, out: SchedulerOutput, preempted: bool) -> bool:
        """Whether `out` may be enqueued before the host has seen the tokens of the step in flight:
        nobody preempted, no penalties or bad words of several tokens (they read every output token
        on the host), and every request with a token still on its way needs only that one as an input
        (a decode row)."""
        return (
            self.config.scheduler.async_scheduling
            and not preempted
            and not any(item.seq.params.needs_output_tokens for item in out.batch)
            and all(item.num_tokens == 1 for item in out.batch if item.seq.num_pending_tokens)
        )

    def _launch_ahead(
        self, out: SchedulerOutput, ahead: InFlight | None, begin: float
    ) -> list[RequestOutput]:
        """Enqueues `out` (a step, or a window of decode steps) behind the work in flight (if any),
        takes what it will have computed as done, then waits for and takes in the work in flight. So
        the GPU starts on `out` the moment it finishes what came before, while the host scheduled and
        filled `out` and then takes in the earlier tokens during it."""
        start = time.perf_counter()
        steps = self._window(out)
        if steps == 1:
            self._ahead = self.runner.launch(out.batch, feed=ahead)
        else:
            self._ahead = self.runner.start_window(out.batch, steps, feed=ahead)
        for _ in range(steps):
            for item in out.batch:
                self._count(item)
                self.scheduler.complete_chunk(item)
                if item.sample:
                    item.seq.num_pending_tokens += 1
        for item in out.batch:
            if item.sample and item.seq.awaits_last_token:
                # Nothing more runs for it: its slot and blocks go back now, as they would once the
                # host had seen that token (whatever reuses them is enqueued behind this step); it
                # finishes as usual when the token lands.
                self.scheduler.finish(item.seq)
        self.metrics.steps_launched_ahead += 1
        self._time_step(out, steps, time.perf_counter() - start)
        self.metrics.host_seconds += start - begin
        return self._finish_in_flight(ahead) if ahead is not None else []

    def _finish_in_flight(self, flight: InFlight) -> list[RequestOutput]:
        """Waits for work launched ahead and takes in its tokens."""
        start = time.perf_counter()
        if isinstance(flight, DecodeWindow):
            results = self.runner.window_results(flight)
        else:
            results = iter([self.runner.result(flight)])
        finished: list[Sequence] = []
        append_token = self.output_processor.append_token
        for order, rows in results:
            sampled = iter(rows)
            for item in order:
                if not item.sample:
                    continue
                row, seq = next(sampled), item.seq
                if seq.num_resolved_in_flight:  # jump-forward appended it already
                    seq.num_resolved_in_flight -= 1
                    continue
                seq.num_pending_tokens -= 1
                if seq.finish_reason is not None:
                    continue  # aborted, or stopped earlier: this token is dropped
                if append_token(seq, row):
                    finished.append(seq)
        outputs = self._finished(finished)
        seconds = time.perf_counter() - start
        if isinstance(flight, DecodeWindow):
            self.metrics.decode_seconds += seconds
        else:
            self.metrics.mixed_seconds += seconds
        return outputs

    def _jump_forward(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Jump-forward for the constrained requests `out` just sampled: where the mask of the token
        a request just sampled allowed that token alone, and the tokens after it are each the one
        its grammar allows, they are appended now. The next step computes them as one chunk and
        samples after them, instead of a step each; the output is what step-by-step decoding gives
        (a forced token is sampled whatever the logits; a seeded draw depends on its output index,
        not on the step). A step still in flight samples the run's first token (and, for a window,
        tokens the host waited for to build the masks): the host appends those too, and passes
        their rows over as they land. Not for requests asking for logprobs (a skipped step has no
        logits).

        Not where steps run in windows and the next would compute output tokens alone (every
        prompt computed, or every seat taken by requests that have sampled): a run's chunk would
        make that step a mixed one, run without a CUDA graph and with the host's work for it each
        step, where the same tokens decode in windows of steps with no round trip. On the
        extraction job of benchmarks/structured.py its last 28 steps took 1.79 s jumping, 0.75 s in
        windows, and while its first 512 requests held every seat, steps of 60-110 ms jumping left
        the device idle 35-50 ms each, where windows ran. A step that admits requests is mixed
        anyway: there runs ride along. Runs already appended are computed by the next step."""
        if not self.config.scheduler.jump_forward:
            return []
        masker = self.runner.masker
        if self.config.scheduler.num_scheduler_steps > 1 and self.scheduler.only_outputs_next:
            masker.forget_recent()
            return []
        masker.note_only_tokens()
        starts: list[Sequence] = []
        for item in out.batch:
            seq, state = item.seq, item.seq.grammar
            if state is None or state.only_token is None:
                continue
            index = state.only_token[0]
            if (
                seq.finished
                or seq.params.logprobs is not None
                or index != seq.num_generated - 1  # not the token it sampled last
                or index != state.consumed
            ):
                state.only_token = None
                continue
            starts.append(seq)
        if not starts:
            return []
        runs = masker.forced_runs(
            [(seq.grammar, seq.max_tokens - seq.num_generated + 1) for seq in starts]  # type: ignore[misc]
        )
        finished: list[Sequence] = []
        for seq, run in zip(starts, runs, strict=True):
            if len(run) < 2:
                continue  # nothing forced beyond the token the step samples anyway
            assert seq.grammar is not None
            known = len(seq.output_token_ids)
            seq.num_resolved_in_flight += seq.num_pending_tokens
            seq.num_pending_tokens = 0
            self.metrics.tokens_jumped += len(run) - 1
            for token in seq.grammar.tokens[known:]:
                if self.output_processor.append_known(seq, token):
                    finished.append(seq)
                    break
        return self._finished(finished)

    def _finished(self, finished: list[Sequence]) -> list[RequestOutput]:
        outputs = []
        for seq in finished:
            self.scheduler.finish(seq)
            self._requests.pop(seq.request_id, None)
            self.metrics.requests_finished += 1
            outputs.append(self.output_processor.output(seq))
        return outputs

    def _window(self, out: SchedulerOutput) -> int:
        """How many decode steps to run before the CPU looks again (1 unless the batch is decode-only)."""
        steps = self.config.scheduler.num_scheduler_steps
        if steps == 1 or not out.is_decode_only:
            return 1
        seqs = [item.seq for item in out.batch]
        if any(s.params.needs_output_tokens or s.num_generated < s.params.min_tokens for s in seqs):
            return 1  # their logits change with every token: the host builds each step's
        steps = min(steps, max(_tokens_left(s) for s in seqs))
        return steps if steps > 1 and self.scheduler.reserve_ahead(seqs, steps) else 1

    def _time_step(self, out: SchedulerOutput, steps: int, seconds: float) -> None:
        m = self.metrics
        m.steps += steps
        if out.is_decode_only:
            m.decode_steps += steps
            m.decode_seconds += seconds
            m.decode_kv_tokens += steps * sum(item.seq.num_computed_tokens for item in out.batch)
        else:
            m.mixed_seconds += seconds

    def _count(self, item: ScheduledSeq) -> None:
        seq = item.seq
        if item.num_tokens == 1 and seq.is_decoding:
            self.metrics.decode_tokens += 1
        else:
            self.metrics.prefill_tokens += item.num_tokens

    # -- what it holds now (read-only; the worker's gauges) ---------------------------------------------

    def kv_cache_usage(self) -> float:
        """The share of the usable KV blocks that requests hold now (cached blocks nobody holds are
        free: they are taken back when needed)."""
        return (self.blocks.num_usable - self.blocks.num_free) / self.blocks.num_usable

    def num_running_requests(self) -> int:
        """Sequences in the running batch: a request of n samples counts n, a group's prefix none."""
        return sum(1 for seq in self.scheduler.running if not seq.is_prefix)

    def num_waiting_requests(self) -> int:
        """Sequences queued and not running (preempted ones included), counted as in
        `num_running_requests`."""
        return sum(1 for seq in self._requests.values() if seq.status is SeqStatus.WAITING)


def _tokens_left(seq: Sequence) -> int:
    """Tokens a request may still produce (those on their way count as produced). max_tokens binds
    before max_model_len: validation keeps prompt + max_tokens within it."""
    return seq.max_tokens - seq.num_generated
