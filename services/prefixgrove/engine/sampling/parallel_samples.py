"""The requests of one `LLM.generate` call: a prompt with SamplingParams.n = k becomes k requests
(sample j gets `params.sample(j)`), they share the prompt's KV as a group, and their completions come
back as one RequestOutput per prompt."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from prefixgrove.gathered_outputs import GatheredOutputs
from prefixgrove.grouping import PrefixGroup

from .outputs import RequestMetrics, RequestOutput
from .sampling_params import SamplingParams


@dataclass(frozen=True)
class Samples:
    """The requests of one generate call: `n` per prompt, `samples[r]` = (prompt, sample index)."""

    batch: int
    samples: list[tuple[int, int]]

    @classmethod
    def of(cls, batch: int, params: list[SamplingParams]) -> Samples:
        return cls(batch, [(i, j) for i, sp in enumerate(params) for j in range(sp.n)])

    @property
    def request_ids(self) -> list[str]:
        return [f"{self.batch}-{i}" if j == 0 else f"{self.batch}-{i}-{j}" for i, j in self.samples]

    def expand(self, per_prompt: list[Any]) -> list[Any]:
        if len(self.samples) == len(per_prompt):
            return per_prompt
        return [per_prompt[i] for i, _ in self.samples]

    def params(self, per_prompt: list[SamplingParams]) -> list[SamplingParams]:
        if len(self.samples) == len(per_prompt):
            return per_prompt
        return [
            per_prompt[i] if per_prompt[i].n == 1 else per_prompt[i].sample(j)
            for i, j in self.samples
        ]

    def groups(self, given: Seq[PrefixGroup], prompts: list[list[int]]) -> list[PrefixGroup]:
        """Groups over prompts -> groups over requests: a group holds all samples of its prompts,
        and a prompt of several samples in no group is a group of its own (whole prompt shared)."""
        if len(self.samples) == len(prompts):
            return list(given)  # one sample each: positions are the same
        rows: dict[int, list[int]] = {}
        for r, (i, _) in enumerate(self.samples):
            rows.setdefault(i, []).append(r)
        for i in (i for g in given for i in g.request_indices if i not in rows):
            raise ValueError(f"a group names prompt {i}, but only {len(prompts)} prompts came")
        out = [
            PrefixGroup(
                g.prefix_len, tuple(r for i in g.request_indices for r in rows[i]), g.prefix_id
            )
            for g in given
        ]
        grouped = {i for g in given for i in g.request_indices}
        out += [
            PrefixGroup(len(prompts[i]), tuple(rs))
            for i, rs in rows.items()
            if len(rs) > 1 and i not in grouped
        ]
        return out

    def merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """One RequestOutput per prompt, its samples' completions in `outputs` (index 0..n-1), its
        metrics those of the samples together."""
        merged: list[RequestOutput] = []
        samples: list[list[RequestMetrics]] = []
        for (_, j), out in zip(self.samples, outputs, strict=True):
            out.outputs[0].index = j
            if j == 0:
                merged.append(out)
                samples.append([])
            else:
                merged[-1].outputs.append(out.outputs[0])
            if out.metrics is not None:
                samples[-1].append(out.metrics)
        for out, metrics in zip(merged, samples, strict=True):
            if len(metrics) > 1:
                out.metrics = RequestMetrics.of_samples(metrics)
        return merged


class SampleSets:
    """Requests added to the engine itself with SamplingParams.n = k (the worker's and the local
    run's path, which hand the engine whole groups): k sequences, sample 0 under the request's own
    id and sample j under `sample_id(id, j)`, sharing the prompt as `Samples` has them share it,
    answered as one RequestOutput once all k finished."""

    def __init__(self) -> None:
        self._gathered = GatheredOutputs(_merged)

    @staticmethod
    def sample_id(request_id: str, index: int) -> str:
        return request_id if index == 0 else f"{request_id}#s{index}"

    def expand(
        self, request_id: str, prompt: Any, params: SamplingParams
    ) -> list[tuple[str, Any, SamplingParams]]:
        """The request's samples as engine requests; a request of one sample is itself."""
        if params.n == 1:
            return [(request_id, prompt, params)]
        return [(self.sample_id(request_id, j), prompt, params.sample(j)) for j in range(params.n)]

    def open(self, request_id: str, n: int) -> None:
        """Called once all samples of the request were accepted by the engine."""
        if n > 1:
            self._gathered.open(request_id, [self.sample_id(request_id, j) for j in range(n)])

    def sample_ids(self, request_id: str) -> list[str]:
        """The engine ids of a request (all its samples), for abort."""
        return self._gathered.part_ids(request_id) or [request_id]

    def forget(self, request_id: str) -> None:
        self._gathered.forget(request_id)

    def collect(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Finished sequences -> finished requests: a sample waits for its request's others."""
        return self._gathered.collect(outputs)


def _merged(request_id: str, samples: list[RequestOutput]) -> RequestOutput:
    merged = samples[0]
    merged.request_id = request_id
    merged.outputs = [s.outputs[0] for s in samples]
    for j, completion in enumerate(merged.outputs):
        completion.index = j
    metrics = [s.metrics for s in samples if s.metrics is not None]
    if len(metrics) > 1:
        merged.metrics = RequestMetrics.of_samples(metrics)
    return merged
