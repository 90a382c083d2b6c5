"""One record per request, and the prefix-sharing group a request may belong to."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..sampling.outputs import Logprob, PromptLogprobs, RequestMetrics
from ..sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ..structured.grammar_state import GrammarState


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request's tokens, its place in the KV cache and its progress.

    `num_computed_tokens` counts tokens whose K/V are in the cache. The first `num_shared_blocks` entries of
    `block_table` belong to the group's prefix and are shared, not owned. `num_pending_tokens` counts
    tokens already sampled on the device whose ids the host has not seen yet (a step enqueued before
    the previous one's tokens came back): they count as tokens, and their ids reach the next step's
    inputs on the device. It and `num_resolved_in_flight` are written by `InFlightTokens`
    (in_flight_tokens.py) alone. `block_hashes` are the prefix cache's hashes of its leading full
    blocks.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling_seed: int
    prompt: str | None = None
    max_tokens: int = 0  # params.max_tokens, or what the context leaves where that is None
    group: Group | None = None
    is_prefix: bool = False  # a group's prefix: prefill only, never samples
    status: SeqStatus = SeqStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    # tokens a step in flight samples that the host appended already (jump-forward knew them: the
    # grammar allowed each alone); their rows are passed over as they land
    num_resolved_in_flight: int = 0
    block_table: list[int] = field(default_factory=list)
    num_shared_blocks: int = 0
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_shared_prefix_tokens: int = 0  # of the cached ones, those of its group's shared prefix
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    output_text: str = ""
    # With params.prompt_logprobs: entry p for prompt token p, filled as the prompt's chunks run
    prompt_logprobs: PromptLogprobs | None = None
    # With params.pooling: the last prompt row's hidden state, or the sum of the rows' over the
    # first `pooled_rows` prompt positions (mean), fp32 (sampling/prompt_logprobs.py fills it)
    pooled: Any = None
    pooled_rows: int = 0
    metrics: RequestMetrics = field(default_factory=RequestMetrics.arriving)
    grammar: GrammarState | None = None  # with params.structured_outputs: its matcher

    def __post_init__(self) -> None:
        if not self.max_tokens:
            self.max_tokens = self.params.max_tokens or 1
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first token has nothing before it

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far, those still on their way to the host included."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_generated > 0 and self.num_uncomputed == 1

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def shared_prefix_len(self) -> int:
        return self.group.prefix_len if self.group is not None and self.num_shared_blocks else 0

    def token_ids(self, start: int, end: int) -> list[int]:
        """Ids of tokens [start, end); 0 stands for a pending token (the device writes its id)."""
        known = len(self.prompt_token_ids) + len(self.output_token_ids)
        if end > known:
            return self.token_ids(start, known) + [0] * (end - max(start, known))
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:  # decode: no copy of the whole prompt
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def own_blocks(self) -> list[int]:
        return self.block_table[self.num_shared_blocks :]


class GroupState(enum.Enum):
    WAITING = "waiting"  # nothing in the cache yet
    COMPUTING = "computing"  # its prefix is being prefilled
    READY = "ready"  # prefix KV in the cache; members may join
    DONE = "done"


@dataclass(eq=False)
class Group:
    """Requests whose prompts start with the same `prefix_len` tokens (a multiple of the block size).

    The prefix is computed once by `prefix_seq`; its blocks stay referenced by the group until every member
    has finished, and each running member holds its own reference on them.
    """

    group_id: str
    prefix_len: int
    prefix_seq: Sequence
    members: list[Sequence]
    state: GroupState = GroupState.WAITING
    pending: list[Sequence] = field(default_factory=list)  # members not yet running, in input order

    def __post_init__(self) -> None:
        self.pending = list(self.members)

    @property
    def prefix_blocks(self) -> list[int]:
        return self.prefix_seq.block_table

    @property
    def num_unfinished(self) -> int:
        return sum(1 for m in self.members if not m.finished)


@dataclass
class ScheduledSeq:
    """A sequence's share of one step."""

    seq: Sequence
    num_tokens: int  # tokens computed for it in this step
    sample: bool  # whether this step ends with a new token for it
