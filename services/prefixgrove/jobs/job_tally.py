"""What a plan needs of each request, tallied as the job is read: its prompt's length and what
bounds its output (max_tokens, min_tokens, n, whether EOS and stops can end it early). A few
numbers a request, so a job of millions is tallied in bounded memory; the grouping's plan then
says which prefix each request shares."""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixgrove.costmodel.workload import RequestTable
from prefixgrove.jobs.ingest import IngestedBatch, JobPlan

# what may end a request before max_tokens when it ignores EOS
_EARLY_ENDS = ("stop", "stop_token_ids", "structured_outputs")


@dataclass(frozen=True)
class OutputBounds:
    """Each request's output tokens per sample: at least `low`, at most `high`; `exact` where
    max_tokens binds (EOS ignored, nothing else that stops it)."""

    low: np.ndarray
    high: np.ndarray
    exact: np.ndarray  # bool

    def expected(self, mean: float | None) -> np.ndarray:
        """Exact rows as they are, the others at an observed mean (capped by their bounds), or
        at their max_tokens when no mean was observed."""
        if mean is None:
            return self.high
        guess = np.clip(np.full(self.high.shape, float(mean)), self.low, self.high)
        return np.where(self.exact, self.high, np.rint(guess).astype(np.int64))


class JobTally:
    """The requests of one model, as `JobIngestor.add` hands them out."""

    def __init__(self) -> None:
        self._index = array.array("q")
        self._prompt = array.array("q")
        self._low = array.array("q")
        self._high = array.array("q")
        self._samples = array.array("q")
        self._exact = array.array("b")

    def __len__(self) -> int:
        return len(self._index)

    def add(self, batch: IngestedBatch) -> None:
        for request, tokens in batch.requests:
            self.add_request(request.index, len(tokens), request.params)

    def add_request(self, index: int, prompt_tokens: int, params: dict[str, Any]) -> None:
        """One request: its line index, prompt length and params (a request's record)."""
        embedding = "pooling" in params  # a pooled row: no token is generated
        high = 0 if embedding else int(params["max_tokens"])
        exact = embedding or (
            bool(params.get("ignore_eos")) and not any(params.get(k) for k in _EARLY_ENDS)
        )
        least = high if exact else min(high, max(1, int(params.get("min_tokens") or 0)))
        self._index.append(index)
        self._prompt.append(prompt_tokens)
        self._high.append(high)
        self._low.append(least)
        self._samples.append(int(params.get("n", 1)))
        self._exact.append(exact)

    def table(self, plan: JobPlan, grouping: bool = True) -> RequestTable:
        """The requests with the prefixes the plan's groups share (none without `grouping`: the
        engine's prefix grouping turned off). A group left with one request shares nothing, as
        the engine runs it."""
        index = np.array(self._index, dtype=np.int64)
        order = np.argsort(index, kind="stable")
        prefix = np.zeros(index.size, dtype=np.int64)
        group = np.full(index.size, -1, dtype=np.int64)
        each_apart = 0  # the groups' prefixes, each group's counted
        for number, unit in enumerate(plan.units if grouping else []):
            rows = order[np.searchsorted(index, unit.indices, sorter=order)]
            if unit.prefix_len and rows.size >= 2:
                prefix[rows], group[rows] = unit.prefix_len, number
                each_apart += unit.prefix_len
        computed = plan.prefix_tokens_computed if grouping else None
        return RequestTable(
            np.array(self._prompt, dtype=np.int64), prefix, group,
            np.array(self._samples, dtype=np.int64),
            prefix_overlap=max(each_apart - computed, 0) if computed is not None else 0,
        )  # fmt: skip

    def outputs(self) -> OutputBounds:
        return OutputBounds(
            np.array(self._low, dtype=np.int64),
            np.array(self._high, dtype=np.int64),
            np.array(self._exact, dtype=bool),
        )
