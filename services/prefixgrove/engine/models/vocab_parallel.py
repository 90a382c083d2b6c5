"""The vocabulary's two matrices cut across tensor-parallel ranks by rows: the embedding (each rank
looks up the ids in its slice, an all-reduce adds the slices) and the LM head (each rank computes
its slice of the logits, an all-gather puts them side by side). Slices hold ceil(vocab / ranks)
rows, the last ones padded with zero rows that no id reaches and whose logits are cut off."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.group import TensorParallel
from .linear import row_invariant_linear
from .sharding import Cut


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: TensorParallel) -> None:
        super().__init__()
        self.parallel = parallel
        self.cut = Cut(0, parallel.size, parallel.rank)
        self.rows = self.cut.local_len(vocab_size)
        self.first = parallel.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        elsewhere = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        out.masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.parallel.all_reduce(out)


def vocab_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    vocab_size: int,
    parallel: TensorParallel,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 logits [rows, vocab] from this rank's rows of the LM head; into `out` when given.
    Gathered in the model's dtype: half the bytes of fp32 on the link."""
    logits = parallel.gather_columns(row_invariant_linear(hidden, weight))
    if logits.shape[1] != vocab_size:
        logits = logits[:, :vocab_size]
    return logits.float() if out is None else out.copy_(logits)
