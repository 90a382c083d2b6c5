"""Requests and groups into the engine: checked, turned into sequences (a group's prefix one of its
own), queued with the scheduler, and ended by abort.

Every request is checked before any of its group is queued; a request of n > 1 samples becomes n
sequences sharing its prompt as a group (`SampleSets`), answered once all n finished.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence as Seq
from dataclasses import KW_ONLY, dataclass, field
from functools import partial
from typing import Any

from prefixgrove.catalog.pooling import pooling_defaults
from prefixgrove.grouping import PrefixGroup

from ..config import EngineConfig
from ..runner.model_runner import ModelRunner
from ..sampling.parallel_samples import SampleSets
from ..sampling.pooling_params import PoolingParams
from ..sampling.sampling_params import SamplingParams
from ..structured.grammar_state import GrammarState
from ..structured.grammars import GrammarCompiler
from .block_manager import BlockManager
from .metrics import EngineMetrics
from .prompt_ids import checked_token_ids
from .scheduler import Scheduler
from .sequence import Group, Sequence

logger = logging.getLogger(__name__)
# A request as add_group takes it: (request_id, prompt_token_ids, params).
NewRequest = tuple[str, Seq[int], SamplingParams]
# A request checked: (request_id, prompt ids as Python ints, the engine's own params).
Checked = tuple[str, list[int], SamplingParams]


@dataclass(eq=False)
class Intake:
    config: EngineConfig
    _: KW_ONLY
    tokenizer: Any
    eos_token_ids: frozenset[int]
    grammars: GrammarCompiler
    blocks: BlockManager
    scheduler: Scheduler
    runner: ModelRunner  # its masker expects each constrained sequence (looked up each time)
    metrics: EngineMetrics
    # unfinished sequences by request id
    requests: dict[str, Sequence] = field(default_factory=dict, init=False)
    # requests of n > 1 samples, answered once all are done
    sample_sets: SampleSets = field(default_factory=SampleSets, init=False)
    _seeds: random.Random = field(init=False)
    _next_id: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._seeds = random.Random(self.config.model.seed)

    def prepare(self, params: SamplingParams) -> SamplingParams:
        """The engine's own checked copy of `params` (they may have changed since they were made):
        ValueError naming the field; token ids are checked against the vocabulary."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        prepared = params.prepared(self.tokenizer, self.eos_token_ids)
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
        if prepared.pooling is not None:
            prepared.pooling = self._pooling(prepared.pooling)
        return prepared

    def _pooling(self, pooling: PoolingParams) -> PoolingParams:
        """The request's pooling with the model's own choices where it leaves them open."""
        resolved = pooling.resolved(*pooling_defaults(self.config.model.model))
        hidden = self.config.model.arch.hidden_size
        if resolved.dimensions is not None and resolved.dimensions > hidden:
            raise ValueError(
                f"PoolingParams.dimensions={resolved.dimensions} is more than the model's "
                f"embedding size, {hidden}"
            )
        return resolved

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> list[int]:
        """Raises ValueError naming the problem (nothing is queued); returns the ids as Python ints."""
        ids = checked_token_ids(prompt_token_ids, self.config.model.arch.vocab_size)
        if params.structured_outputs is not None:  # compiled once per constraint, then cached
            self.grammars.compile(params.structured_outputs)
        if params.pooling is not None:
            self._pooling(params.pooling)
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
        alone = [m for m in members if m[2].prompt_logprobs is not None or m[2].pools_every_row]
        members = [m for m in members if m[2].prompt_logprobs is None and not m[2].pools_every_row]
        prefix_len = self._shared_prefix_len(group_id, group.prefix_len, members) if members else 0
        seqs = [self._new_sequence(rid, ids, params) for rid, ids, params in members + alone]
        if prefix_len:
            self.scheduler.add(self._group(group_id, prefix_len, seqs[: len(members)]))
            seqs = seqs[len(members) :]
        for seq in seqs:
            self.scheduler.add(seq)
        self.metrics.intake_seconds += time.perf_counter() - begin

    def abort(self, request_ids: Seq[str]) -> set[str]:
        """Ends the requests, every sample of each; returns the sample ids whose outputs are no
        longer answered: all of them where one request was of several samples, else none."""
        samples = {sample for r in request_ids for sample in self.sample_sets.sample_ids(r)}
        for rid in samples:
            seq = self.requests.pop(rid, None)
            if seq is not None and not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
                if seq.grammar is not None:
                    seq.grammar.ended = True  # nothing is built or masked ahead for it any more
        dropped: set[str] = set()
        for rid in request_ids:
            if len(self.sample_sets.sample_ids(rid)) > 1:  # none of its samples is answered
                dropped = samples
                self.sample_sets.forget(rid)
        return dropped

    def _check_group(
        self, group_id: str, group: PrefixGroup, requests: Seq[NewRequest], validated: bool
    ) -> list[Checked]:
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
                for sample in self.sample_sets.expand(rid, ids, params)[1:]:
                    self._check_new(sample[0], ids, sample[2], validated=True)
            except ValueError as e:
                raise ValueError(f"request {rid!r} of group {group_id!r}: {e}") from None
            checked += self.sample_sets.expand(rid, ids, params)
            samples.append((rid, params.n))
        for rid, n in samples:  # only once every request of the group is accepted
            self.sample_sets.open(rid, n)
        return checked

    def _shared_prefix_len(self, group_id: str, prefix_len: int, members: list[Checked]) -> int:
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
        if request_id in self.requests:
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
            eos = () if params.ignore_eos else self.eos_token_ids
            seq.grammar = GrammarState(
                partial(self.grammars.matcher, grammar),
                frozenset(eos),
                self.grammars.tokenizer.vocab_size,
                f"structured_outputs.{params.structured_outputs.kind}",
            )
            self.runner.masker.expect(seq.grammar)
        self.requests[request_id] = seq
        return seq

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """max_tokens, or where that is None all the context leaves after the prompt."""
        if params.max_tokens is not None:
            return params.max_tokens
        return self.config.model.max_model_len - prompt_len

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id
