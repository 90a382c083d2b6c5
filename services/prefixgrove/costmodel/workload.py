"""A job's work, counted: the tokens its prefill and decode steps compute, the (query, key) pairs
its attention forms and the keys and values its decode steps read, from each request's prompt,
shared prefix, samples and output length."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RequestTable:
    """One row per request that runs, in any order. prefix: the tokens its group shares (0 for a
    request in no group); group: its group's number (-1 for none); samples: n."""

    prompt: np.ndarray
    prefix: np.ndarray
    group: np.ndarray
    samples: np.ndarray
    # tokens of the groups' prefixes that another group's prefix computed first (leading blocks
    # they share): the prefix cache gives them, so the prefill counts them once
    prefix_overlap: int = 0

    def __len__(self) -> int:
        return int(self.prompt.size)


@dataclass(frozen=True)
class Workload:
    requests: int
    sequences: int  # requests times their samples: what decodes
    prefill_tokens: int  # the groups' prefixes (shared leading blocks once), every request's own
    prefill_pairs: float  # causal (query, key) pairs of the prefill
    output_tokens: int
    decode_tokens: int  # the tokens decode steps take in: each sequence's outputs but its first
    decode_pairs: float  # (query, key) pairs of the decode steps
    decode_kv_reads: float  # tokens of keys and values decode steps read (a prefix once per group)
    longest_decode: int  # the most decode steps one sequence takes
    held_per_sequence: float  # KV tokens a decoding sequence holds, its share of a prefix included

    @classmethod
    def of(cls, table: RequestTable, outputs: np.ndarray, cascade: bool = True) -> Workload:
        """The work of `table`'s requests when each sample makes outputs[i] tokens."""
        prompt, prefix = table.prompt.astype(np.float64), table.prefix.astype(np.float64)
        n, out = table.samples.astype(np.float64), outputs.astype(np.float64)
        own = prompt - prefix
        prefixes = _group_prefixes(table)
        steps = np.maximum(out - 1, 0)  # the first token comes from the prompt's last row
        # decode step k (1..steps) attends its prompt and k outputs
        pairs = n * (steps * prompt + steps * (steps + 1) / 2)
        own_reads = n * (steps * own + steps * (steps + 1) / 2)
        shared_reads = _prefix_reads(table, steps) if cascade else float((n * steps * prefix).sum())
        sequences = float(n.sum())
        held = (n * (own + out / 2)).sum() + prefixes.sum()
        return cls(
            requests=len(table),
            sequences=int(sequences),
            prefill_tokens=int(own.sum() + prefixes.sum()) - table.prefix_overlap,
            prefill_pairs=float(
                (own * prefix + own * (own + 1) / 2).sum() + (prefixes * (prefixes + 1) / 2).sum()
            ),
            output_tokens=int((n * out).sum()),
            decode_tokens=int((n * steps).sum()),
            decode_pairs=float(pairs.sum()),
            decode_kv_reads=float(own_reads.sum()) + shared_reads,
            longest_decode=int(steps.max()) if steps.size else 0,
            held_per_sequence=float(held / sequences) if sequences else 0.0,
        )


def _group_prefixes(table: RequestTable) -> np.ndarray:
    """Each group's prefix length, once."""
    grouped = table.group >= 0
    if not grouped.any():
        return np.zeros(0)
    _, first = np.unique(table.group[grouped], return_index=True)
    return table.prefix[grouped][first].astype(np.float64)


def _prefix_reads(table: RequestTable, steps: np.ndarray) -> float:
    """Prefix tokens read by decode steps under cascade attention: a group's prefix once per step
    while any of its sequences decodes."""
    grouped = table.group >= 0
    if not grouped.any():
        return 0.0
    groups, inverse = np.unique(table.group[grouped], return_inverse=True)
    longest = np.zeros(groups.size)
    np.maximum.at(longest, inverse, steps[grouped])
    prefix = np.zeros(groups.size)
    prefix[inverse] = table.prefix[grouped]
    return float((longest * prefix).sum())
