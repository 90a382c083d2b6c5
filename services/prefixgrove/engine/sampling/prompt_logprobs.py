"""Prompt logprobs (SamplingParams.prompt_logprobs): the log-probability of every prompt token given
the tokens before it, with the top k, as vLLM returns them.

The hidden state at position p scores token p + 1, so a prefill chunk of positions [start, end) scores
tokens start + 1 .. end (those still in the prompt; the prompt's last position samples the first output
token instead). A sequence's entries are filled chunk by chunk; a chunk computed again (after a
preemption) finds its entries there already and is not scored twice. A request that asks for them runs
outside prefix groups (`LLMEngine.add_group`): a shared prefix is computed by its own prefill-only
sequence, never through this request's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.sequence import ScheduledSeq, Sequence
from .outputs import Logprob

# Rows turned into vocabulary-wide logits at once: a long chunk would need [rows, vocab] fp32 whole.
_ROWS_PER_SLICE = 256


@dataclass(frozen=True)
class PromptSpan:
    """Rows [row, row + count) of a step score prompt tokens first_token .. first_token + count - 1;
    with `pool`, they are the hidden states of prompt positions first_token .. first_token + count
    - 1 that an embedding request pools (pooling_params.py), and score nothing."""

    seq: Sequence
    row: int
    first_token: int
    count: int
    pool: bool = False


def prompt_spans(order: list[ScheduledSeq]) -> list[PromptSpan]:
    """The spans of a step's rows (laid out in `order`, before the step is counted as computed) whose
    logits score prompt tokens not scored yet, or whose hidden states an embedding pools."""
    spans, offset = [], 0
    for item in order:
        seq, start = item.seq, item.seq.num_computed_tokens
        if seq.prompt_logprobs is not None:
            first = max(start + 1, len(seq.prompt_logprobs))
            end = min(start + item.num_tokens, seq.num_prompt_tokens - 1) + 1
            if first < end:
                spans.append(PromptSpan(seq, offset + first - 1 - start, first, end - first))
        if seq.params.pooling is not None:
            spans += _pool_span(item, offset)
        offset += item.num_tokens
    return spans


def _pool_span(item: ScheduledSeq, offset: int) -> list[PromptSpan]:
    """The rows of the step an embedding pools: its last prompt row ("last"), or every prompt row
    not pooled yet ("mean"); a chunk computed again after a preemption is not pooled twice."""
    seq, start = item.seq, item.seq.num_computed_tokens
    assert seq.params.pooling is not None
    last = seq.num_prompt_tokens - 1
    first = seq.pooled_rows if seq.params.pooling.pooling_type == "mean" else last
    if seq.pooled_rows > last or not start <= first < start + item.num_tokens:
        return []  # pooled already, or its next row is not in this step
    end = min(last + 1, start + item.num_tokens)
    return [PromptSpan(seq, offset + first - start, first, end - first, pool=True)]


@torch.inference_mode()
def record_prompt_logprobs(
    spans: list[PromptSpan],
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Appends each span's entries to its sequence (an embedding's: its pooled rows).
    hidden: [num_tokens, hidden_size], every row of the step through the last layer;
    compute_logits: hidden rows -> fp32 logits [rows, vocab]."""
    for span in spans:
        if span.pool:
            _pool(span, hidden)
            continue
        entries = []
        for at, n in _slices(span):
            first = span.first_token + at
            tokens = span.seq.prompt_token_ids[first : first + n]
            logits = compute_logits(hidden[span.row + at : span.row + at + n])
            entries += _entries(logits, tokens, span.seq.params.prompt_logprobs or 0)
        recorded = span.seq.prompt_logprobs
        assert recorded is not None  # spans are made only for sequences that record them
        if len(recorded) != span.first_token:
            raise RuntimeError(
                f"request {span.seq.request_id!r}: prompt logprobs were computed up to token "
                f"{len(recorded)} but its next chunk scores from token {span.first_token}: the "
                "tokens between took their KV from a cache and were never scored"
            )
        recorded += entries


def _pool(span: PromptSpan, hidden: torch.Tensor) -> None:
    """Adds the span's rows to its sequence's pooled state (fp32)."""
    seq = span.seq
    rows = hidden[span.row : span.row + span.count].float().sum(dim=0)
    seq.pooled = rows if seq.pooled is None else seq.pooled + rows
    seq.pooled_rows = span.first_token + span.count


def _slices(span: PromptSpan) -> list[tuple[int, int]]:
    """(offset in the span, rows) of each slice turned into logits at once."""
    return [
        (at, min(_ROWS_PER_SLICE, span.count - at)) for at in range(0, span.count, _ROWS_PER_SLICE)
    ]


def logit_row_slices(spans: list[PromptSpan]) -> list[tuple[int, int]]:
    """(first row, rows) of the hidden states `record_prompt_logprobs` turns into logits, in the
    order it does: a tensor-parallel follower makes the same calls of the sharded LM head."""
    return [(span.row + at, n) for span in spans if not span.pool for at, n in _slices(span)]


def _entries(logits: torch.Tensor, tokens: list[int], k: int) -> list[dict[int, Logprob]]:
    """logits: [n, vocab] fp32 at the positions before `tokens`. The rank is 1 + the number of tokens
    more likely, as the sampler ranks a sampled token."""
    logprobs = logits.log_softmax(dim=-1)
    ids = torch.tensor(tokens, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids)
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top = logprobs.topk(k, dim=-1) if k else None
    top_ids = top.indices.tolist() if top is not None else [[]] * len(tokens)
    top_vals = top.values.tolist() if top is not None else [[]] * len(tokens)
    out = []
    for token, value, rank, row_ids, row_vals in zip(
        tokens, chosen.squeeze(1).tolist(), ranks, top_ids, top_vals, strict=True
    ):
        entry = {token: Logprob(value, rank)}
        for r, (tid, val) in enumerate(zip(row_ids, row_vals, strict=True), start=1):
            entry.setdefault(tid, Logprob(val, r))
        out.append(entry)
    return out
