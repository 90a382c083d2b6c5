"""A completions line whose `prompt` is several prompts (OpenAI's list of strings or of token lists):
one line, one answer, whose choices are each prompt's samples in turn (choice index = prompt
index × n + sample index, as OpenAI and vLLM number them).

The line travels as one request: its prompts' token ids one after another, and in its params
`prompt_parts`, each prompt's token count (so that its fingerprint tells ["ab", "c"] from
["a", "bc"]). It is never grouped by shared prefix (`groupable`): its prompts need not share one.
At the engine, `PartsEngine` runs each prompt as a request of its own (`<id>#p<k>`) and hands
back one RequestOutput once all of them finished; every other request passes through unchanged.
The worker and the local run both drive their engine through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from prefixgrove.gathered_outputs import GatheredOutputs

if TYPE_CHECKING:  # the shared job model imports no engine; these are only types
    from prefixgrove.engine import RequestOutput, SamplingParams
    from prefixgrove.grouping import PrefixGroup

PARTS = "prompt_parts"  # params key: each prompt's token count, in order


@dataclass(frozen=True)
class PromptParts:
    """The prompts of one request, each its token ids."""

    parts: tuple[Sequence[int], ...]


def split(tokens: Sequence[int] | np.ndarray, params: dict[str, Any]) -> Any:
    """A request's prompt as the engine takes it: PromptParts for a line of several prompts,
    else its token ids as they are."""
    counts = params.get(PARTS)
    if not counts:
        return tokens
    ends = np.cumsum(counts)
    parts = (tokens[end - count : end] for count, end in zip(counts, ends, strict=True))
    return PromptParts(tuple(cast(Sequence[int], part) for part in parts))


def groupable(tokens: np.ndarray, params: dict[str, Any]) -> np.ndarray:
    """What grouping may see of a request's prompt: a line of several prompts offers it no
    prefix to share (one token keeps nothing shareable)."""
    return tokens[:1] if params.get(PARTS) else tokens


def part_id(request_id: str, part: int) -> str:
    return f"{request_id}#p{part}"


class PartsEngine:
    """An engine that takes PromptParts prompts too: each part runs as a request of its own, and
    the parts' outputs come back merged, once all finished, under the request's id. Anything
    else is the wrapped engine's."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._gathered: GatheredOutputs[RequestOutput] = GatheredOutputs(_merged)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def validate(self, prompt_ids: Any, params: SamplingParams, /) -> Any:
        if isinstance(prompt_ids, PromptParts):
            return PromptParts(tuple(self.engine.validate(p, params) for p in prompt_ids.parts))
        return self.engine.validate(prompt_ids, params)

    def add_request(
        self, request_id: str, prompt_ids: Any, params: SamplingParams, /, **kw: Any
    ) -> None:
        if not isinstance(prompt_ids, PromptParts):
            self.engine.add_request(request_id, prompt_ids, params, **kw)
            return
        kw.pop("prompt", None)  # a text names no one part
        ids = [part_id(request_id, k) for k in range(len(prompt_ids.parts))]
        for k, (pid, part) in enumerate(zip(ids, prompt_ids.parts, strict=True)):
            try:
                self.engine.add_request(pid, part, params, **kw)
            except Exception:
                self.engine.abort(ids[:k])  # none of the request runs
                raise
        self._gathered.open(request_id, ids)

    def add_group(
        self, group_id: str, group: PrefixGroup, requests: Sequence[Any], /, **kw: Any
    ) -> None:
        """The group's requests of several prompts run alone (they share no prefix)."""
        members = [requests[i] for i in group.request_indices]
        plain = [m for m in members if not isinstance(m[1], PromptParts)]
        if plain:
            shared = type(group)(group.prefix_len, tuple(range(len(plain))))
            self.engine.add_group(group_id, shared, plain, **kw)
        for request_id, prompt, params in members:
            if isinstance(prompt, PromptParts):
                self.add_request(request_id, prompt, params, **kw)

    def step(self) -> list[RequestOutput]:
        return self._gathered.collect(self.engine.step())

    def abort(self, request_ids: Sequence[str], /) -> Any:
        ids = [pid for rid in request_ids for pid in self._gathered.forget(rid) or [rid]]
        return self.engine.abort(ids)


def _merged(request_id: str, parts: list[RequestOutput]) -> RequestOutput:
    """One output of the parts' outputs: their choices in turn, their prompts one after another."""
    n = len(parts[0].outputs)
    choices = []
    for k, out in enumerate(parts):
        for completion in out.outputs:
            completion.index = k * n + completion.index
            choices.append(completion)
    merged = parts[0]
    merged.request_id, merged.prompt, merged.outputs = request_id, None, choices
    merged.prompt_token_ids = [t for out in parts for t in out.prompt_token_ids]
    merged.num_cached_tokens = sum(out.num_cached_tokens for out in parts)
    merged.num_shared_prefix_tokens = sum(out.num_shared_prefix_tokens for out in parts)
    metrics = [out.metrics for out in parts if out.metrics is not None]
    if len(metrics) > 1:
        merged.metrics = type(metrics[0]).of_samples(metrics)
    return merged
