"""What a sampled token does to its request: logprobs recorded, stop conditions checked, and the
finished request turned into a RequestOutput."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..core.sequence import Sequence
from ..models.arch import ModelArch
from .detokenizer import Detokenizer, DetokState
from .outputs import CompletionOutput, Logprob, RequestOutput


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        arch: ModelArch,
        max_model_len: int,
        generation_eos_token_ids: Iterable[int] = (),
    ) -> None:
        """EOS is every id the checkpoint names: its config's, its tokenizer's and its
        generation_config's (vLLM stops at the last two)."""
        self.detokenizer = Detokenizer(tokenizer, arch.vocab_size)
        eos = set(arch.eos_token_ids) | set(generation_eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.max_model_len = max_model_len
        self._detok: dict[int, DetokState] = {}  # seq_id -> text so far, for stop strings

    def append_token(self, seq: Sequence, row: np.ndarray) -> bool:
        """Adds the sampled token; returns whether the request is now finished."""
        if self.constraint_failed(seq):
            return True  # (as in append_known)
        token = int(row[0])
        if seq.params.logprobs is not None:
            self._record_logprobs(seq, token, row)
        return self.append_known(seq, token)

    def append_known(self, seq: Sequence, token: int) -> bool:
        """Adds a token known without its step's row (a forced one: jump-forward; never asked for
        logprobs); returns whether the request is now finished."""
        if self.constraint_failed(seq):
            return True  # `token` was sampled without its constraint: it is dropped
        seq.output_token_ids.append(token)
        seq.metrics.token(time.time())
        if self._stops(seq, token):
            seq.finish_reason = "stop"
        elif (
            len(seq.output_token_ids) >= seq.max_tokens
            # tokens the host has seen: one sampled by a step in flight is not counted here
            or len(seq.prompt_token_ids) + len(seq.output_token_ids) >= self.max_model_len
        ):
            seq.finish_reason = "length"
        if seq.finish_reason is not None and seq.grammar is not None:
            seq.grammar.settle(seq.output_token_ids)
            self.constraint_failed(seq)
        return seq.finish_reason is not None

    @staticmethod
    def constraint_failed(seq: Sequence) -> bool:
        """Whether the request's structured-output constraint could not be enforced (its matcher
        failed: grammar_state.py); it then ends with finish_reason "error", never decoding on
        unconstrained nor passing for an answer."""
        if seq.grammar is None or seq.grammar.error is None:
            return False
        seq.finish_reason = "error"
        return True

    def _stops(self, seq: Sequence, token: int) -> bool:
        """Whether `token` (just appended) ends the request: a stop token, EOS or a stop string, none of
        which counts before min_tokens output tokens (the text still advances for stop strings)."""
        p = seq.params
        if len(seq.output_token_ids) < p.min_tokens:
            if p.stop:
                self._hit_stop_string(seq, search=False)
            return False
        if token in p.stop_token_ids:
            seq.stop_reason = token
            return True
        return (not p.ignore_eos and token in self.eos_token_ids) or (
            bool(p.stop) and self._hit_stop_string(seq)
        )

    def _record_logprobs(self, seq: Sequence, token: int, row: np.ndarray) -> None:
        k = seq.params.logprobs or 0
        entry = {token: Logprob(float(row[1]), int(row[2]))}
        top_ids, top_vals = row[3 : 3 + (len(row) - 3) // 2], row[3 + (len(row) - 3) // 2 :]
        for rank, (tid, val) in enumerate(zip(top_ids[:k], top_vals[:k], strict=True), start=1):
            entry.setdefault(int(tid), Logprob(float(val), rank))
        if seq.logprobs is None:
            seq.logprobs = []
        seq.logprobs.append(entry)
        seq.cumulative_logprob += float(row[1])

    def _hit_stop_string(self, seq: Sequence, search: bool = True) -> bool:
        state = self._detok.setdefault(seq.seq_id, DetokState())
        new = self.detokenizer.step(state, seq.output_token_ids, seq.params.skip_special_tokens)
        if not new or not search:
            return False
        # Only a stop string ending in the new text counts: text before min_tokens never stops it.
        old = len(state.text) - len(new)
        hits = [(state.text.find(s, max(0, old - len(s) + 1)), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        keep = at + len(stop) if seq.params.include_stop_str_in_output else at
        seq.output_text = state.text[:keep]
        seq.stop_reason = stop
        return True

    def output(self, seq: Sequence) -> RequestOutput:
        p = seq.params
        text = seq.output_text
        if not text and p.detokenize and not isinstance(seq.stop_reason, str):
            text = self.detokenizer.decode(seq.output_token_ids, p.skip_special_tokens)
        self._detok.pop(seq.seq_id, None)
        seq.metrics.finished_time = time.time()
        if p.detokenize:
            self._name_tokens(seq.logprobs)
            self._name_tokens(seq.prompt_logprobs)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=seq.logprobs,
            cumulative_logprob=seq.cumulative_logprob if p.logprobs is not None else None,
            error=seq.grammar.error if seq.grammar is not None else None,
            embedding=p.pooling.embedding(seq.pooled, seq.num_prompt_tokens)
            if p.pooling is not None and seq.pooled is not None
            else None,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=True,
            num_cached_tokens=seq.num_cached_tokens,
            num_shared_prefix_tokens=seq.num_shared_prefix_tokens,
            metrics=seq.metrics,
            prompt_logprobs=seq.prompt_logprobs,
        )

    def _name_tokens(self, entries: Iterable[dict[int, Logprob] | None] | None) -> None:
        """Each Logprob's decoded_token: its token decoded alone, as vLLM gives it."""
        for entry in entries or ():
            for token, logprob in (entry or {}).items():
                logprob.decoded_token = self.detokenizer.token_text(token)
