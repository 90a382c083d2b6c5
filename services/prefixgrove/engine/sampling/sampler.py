"""One batched pass that turns the step's logits into tokens (and logprobs) for every request.

Randomness comes from a counter-based hash of (request seed, output index, token id), not from a stateful
generator: a seeded request draws the same tokens whatever else is in its batch, on CPU or GPU, and however
many decode steps run per CPU round trip. Everything the CPU needs comes back in one packed tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..core.sequence import Sequence
from ..device import to_device

if TYPE_CHECKING:
    from ..structured.masks import TokenMask

_MASK32 = 0xFFFFFFFF
_BELOW_ONE = 1.0 - 2.0**-24  # the largest fp32 below 1


def hash32(x: Any) -> Any:
    # A 32-bit integer mixer; every product stays below 2**59, so int64 arithmetic never overflows.
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def uniform(x: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> fp32 draws in (0, 1) from their top 24 bits."""
    # NOTE: the top draw, (2**24 - 0.5) / 2**24, rounds to 1.0 in fp32, where -log(u) = 0 would make
    # any token with p > 0 win the race (p / 0 = inf) and a masked one NaN: u stays below 1.
    return (((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))).clamp_(max=_BELOW_ONE)


def row_key(seed: Any, step: Any) -> Any:
    """The noise key of a request's `step`-th output token (ints, or int64 arrays of them)."""
    lo, hi = seed & _MASK32, (seed >> 32) & _MASK32
    base = hash32(lo ^ hash32(hi))
    return hash32(base ^ ((step * 0x9E3779B9) & _MASK32))


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, on the device."""

    temperature: torch.Tensor  # [n] fp32 (0 = greedy)
    top_k: torch.Tensor  # [n] int64 (0 = off)
    top_p: torch.Tensor  # [n] fp32
    min_p: torch.Tensor  # [n] fp32
    keys: torch.Tensor  # [steps, n] int64 noise keys: row j is for the j-th token from now
    all_greedy: bool
    need_sort: bool
    need_min_p: bool
    num_logprobs: int  # top-n alternatives to return (max over rows); -1 = no logprobs at all
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    adjust: LogitAdjust | None = None  # None unless a row biases or masks logits this step

    @classmethod
    def build(
        cls,
        seqs: list[Sequence],
        device: torch.device,
        vocab_size: int,
        steps: int = 1,
    ) -> SamplingBatch:
        """Settings for `steps` steps whose first samples each request's output token number
        num_generated."""
        ps = [s.params for s in seqs]
        floats = np.array(
            [[p.temperature, p.top_p, p.min_p] for p in ps], dtype=np.float32
        ).reshape(-1, 3)
        ints = np.empty((1 + steps, len(seqs)), dtype=np.int64)
        ints[0] = [min(p.top_k, vocab_size) for p in ps]  # beyond the vocabulary is all of it
        seeds = np.array([s.sampling_seed for s in seqs], dtype=np.int64)
        produced = np.array([s.num_generated for s in seqs], dtype=np.int64)
        # Noise keys of this step and of the window's later steps, all at once.
        ints[1:] = row_key(seeds[None, :], produced[None, :] + np.arange(steps)[:, None])
        f, i = to_device(floats, device), to_device(ints, device)
        logprob_counts = [p.logprobs for p in ps if p.logprobs is not None]
        return cls(
            temperature=f[:, 0],
            top_p=f[:, 1],
            min_p=f[:, 2],
            top_k=i[0],
            keys=i[1:],
            all_greedy=all(p.greedy for p in ps),
            need_sort=any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in ps),
            need_min_p=any(not p.greedy and p.min_p > 0 for p in ps),
            num_logprobs=max(logprob_counts) if logprob_counts else -1,
            penalties=_penalty_tensors(seqs, device, vocab_size)
            if any(p.has_penalties for p in ps)
            else None,
            adjust=LogitAdjust.build(seqs, device, vocab_size)
            if any(p.adjusts_logits for p in ps)
            else None,
        )


@dataclass
class LogitAdjust:
    """The logits some rows of a step change, as index lists on the device: only `allowed` may be
    sampled in `allowed_rows`, `bias` is added, `banned` (EOS and stop ids below min_tokens, bad
    words) goes to -inf. Built on the host each step: min_tokens and bad words depend on the output
    so far (a window of several steps runs only while they bind no row; llm_engine sees to that)."""

    allowed_rows: torch.Tensor  # [k] rows with allowed_token_ids
    allowed: torch.Tensor  # [k, vocab] bool
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # rows, token ids, fp32 values
    banned: tuple[torch.Tensor, torch.Tensor]  # rows, token ids

    @classmethod
    def build(cls, seqs: list[Sequence], device: torch.device, vocab: int) -> LogitAdjust:
        allowed_rows: list[int] = []
        allowed_at: list[tuple[int, int]] = []  # (index into allowed_rows, token id)
        bias_at: list[tuple[int, int]] = []
        bias_values: list[float] = []
        banned_at: list[tuple[int, int]] = []
        for r, seq in enumerate(seqs):
            p = seq.params
            if p.allowed_token_ids:
                allowed_at += [(len(allowed_rows), t) for t in p.allowed_token_ids]
                allowed_rows.append(r)
            bias_at += [(r, t) for t in p.logit_bias or {}]
            bias_values += (p.logit_bias or {}).values()
            banned_at += [(r, t) for t in banned_token_ids(seq, vocab)]
        mask = torch.zeros(len(allowed_rows), vocab, dtype=torch.bool, device=device)
        mask[_pairs(allowed_at, device)] = True
        return cls(
            allowed_rows=to_device(np.array(allowed_rows, dtype=np.int64), device),
            allowed=mask,
            bias=(*_pairs(bias_at, device), to_device(np.array(bias_values, np.float32), device)),
            banned=_pairs(banned_at, device),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [n, vocab] -> a changed copy."""
        rows = self.allowed_rows
        if len(rows):
            logits = logits.index_put((rows,), logits[rows].masked_fill(~self.allowed, -math.inf))
        logits = logits.index_put(self.bias[:2], self.bias[2], accumulate=True)
        return logits.index_put(self.banned, logits.new_tensor(-math.inf))


def banned_token_ids(seq: Sequence, vocab: int) -> list[int]:
    """Token ids `seq` may not sample next: its stop ids (EOS unless ignore_eos) while below
    min_tokens, and the last token of each bad word whose earlier tokens end its output (vLLM's
    rule; a bad word of one token always)."""
    p, out = seq.params, seq.output_token_ids
    ids = list(p.min_tokens_stop_ids) if seq.num_generated < p.min_tokens else []
    for word in p.bad_words_token_ids:
        before = len(word) - 1
        if before == 0 or (before <= len(out) and tuple(out[len(out) - before :]) == word[:-1]):
            ids.append(word[-1])
    return [t for t in ids if t < vocab]


def _pairs(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) pairs -> a rows tensor and a token ids tensor, for indexing [n, vocab]."""
    both = to_device(np.array(pairs, dtype=np.int64).reshape(-1, 2).T.copy(), device)
    return both[0], both[1]


def _penalty_tensors(seqs: list[Sequence], device: torch.device, vocab: int):
    n = len(seqs)
    out_len = max(1, max(len(s.output_token_ids) for s in seqs))
    prompt_len = max(1, max(s.num_prompt_tokens for s in seqs))
    outputs = np.full((n, out_len), vocab, dtype=np.int64)
    prompts = np.full((n, prompt_len), vocab, dtype=np.int64)
    for r, s in enumerate(seqs):
        outputs[r, : len(s.output_token_ids)] = s.output_token_ids
        prompts[r, : s.num_prompt_tokens] = s.prompt_token_ids
    values = np.array(
        [
            [s.params.presence_penalty, s.params.frequency_penalty, s.params.repetition_penalty]
            for s in seqs
        ],
        dtype=np.float32,
    )
    v = to_device(values, device)
    return (
        to_device(outputs, device),
        to_device(prompts, device),
        v[:, 0],
        v[:, 1],
        v[:, 2],
    )


def apply_penalties(logits: torch.Tensor, penalties) -> torch.Tensor:
    outputs, prompts, presence, frequency, repetition = penalties
    n, vocab = logits.shape
    counts = torch.zeros(n, vocab + 1, device=logits.device, dtype=logits.dtype)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=logits.dtype))
    counts = counts[:, :vocab]
    seen = torch.zeros(n, vocab + 1, device=logits.device, dtype=torch.bool)
    seen.scatter_(1, prompts, True)
    seen = seen[:, :vocab] | (counts > 0)
    rep = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency.unsqueeze(1) * counts
    return logits - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


class Sampler:
    """logits [n, vocab] fp32 -> packed [n, 3 + 2k] fp32: token, its logprob, its rank, top-k ids, top-k
    logprobs. Token ids are exact in fp32 (vocabularies are far below 2**24)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        mixed = (torch.arange(vocab_size, dtype=torch.int64, device=device) * 0x27D4EB2F) & _MASK32
        self._vocab_keys = mixed  # [vocab]

    def __call__(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        step: int = 0,
        mask: TokenMask | None = None,
    ) -> torch.Tensor:
        raw = logits
        if mask is not None:  # structured outputs; logprobs stay those of the model's own logits
            logits = logits.clone() if batch.num_logprobs >= 0 else logits
            apply_token_mask(logits, mask)
        if batch.adjust is not None:
            logits = batch.adjust.apply(logits)
        if batch.penalties is not None:
            logits = apply_penalties(logits, batch.penalties)
        tokens = logits.argmax(dim=-1)
        if not batch.all_greedy:
            sampled = self._sample(logits, batch, batch.keys[step])
            tokens = torch.where(batch.temperature == 0, tokens, sampled)
        return self._pack(raw, tokens, batch.num_logprobs)

    def _sample(
        self, logits: torch.Tensor, batch: SamplingBatch, keys: torch.Tensor
    ) -> torch.Tensor:
        temp = torch.where(batch.temperature == 0, 1.0, batch.temperature).unsqueeze(1)
        logits = logits / temp
        if batch.need_sort:
            logits = _top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = logits.softmax(dim=-1)
        if batch.need_min_p:
            keep = probs >= batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(keep, probs, 0.0)
        # Exponential race (Gumbel-max): argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i.
        u = uniform(hash32(keys.unsqueeze(1) ^ self._vocab_keys.unsqueeze(0)))
        return (probs / -torch.log(u)).argmax(dim=-1)

    def _pack(self, raw: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
        cols = [tokens.to(torch.float32).unsqueeze(1)]
        if k < 0:
            return cols[0]
        logprobs = raw.log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens.unsqueeze(1))
        rank = (logprobs > chosen).sum(dim=-1, keepdim=True).to(torch.float32) + 1
        cols += [chosen, rank]
        if k > 0:
            top = logprobs.topk(k, dim=-1)
            cols += [top.indices.to(torch.float32), top.values]
        return torch.cat(cols, dim=1)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """-inf, in place, for the tokens a constrained row may not take: one kernel on the GPU."""
    if logits.is_cuda:
        from prefixgrove_kernels.token_mask import apply_token_bitmask

        apply_token_bitmask(logits, mask.bitmask, mask.rows)
    else:
        from prefixgrove_kernels.token_mask import apply_token_bitmask_ref

        apply_token_bitmask_ref(logits, mask.bitmask, mask.rows)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
