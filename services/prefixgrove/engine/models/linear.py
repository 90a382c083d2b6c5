"""The model's matmuls, with one rule on the CPU: a row's result does not depend on the other rows of
its batch, so a request gets the same bytes (tokens and logprobs) alone or beside any others.

CPU BLAS libraries pick their kernel by the number of rows: with oneDNN/MKL one row, a few rows and
many rows are three kernels that sum the inner dimension in three orders, so the same row differs in
the last bits with the batch around it (a decode step of 3 requests against one of 40). On the CPU
every product therefore runs in calls of exactly `ROW_BLOCK` rows (the last one zero-padded): each
row goes through the same call shape, the same kernel, the same summation order, wherever it sits.
The blocks go through one batched call (`torch.bmm`, which runs each block as its own product), so
the cost is the padding alone.

CUDA tensors take one plain `F.linear`: cuBLAS also chooses kernels by shape, but blocking there would
cost every step real time, so on the GPU a row's last bits may follow its batch (docs/engine-api.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows per CPU matmul call. Any fixed size keeps rows independent of their batch; 16 keeps a decode
# step's padding small while prefill chunks of hundreds of rows take few calls.
ROW_BLOCK = 16


def row_invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T (+ bias) -> [..., out]; on the CPU in blocks of ROW_BLOCK rows."""
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    padded_rows = -(-n // ROW_BLOCK) * ROW_BLOCK
    if padded_rows != n:
        rows = torch.cat([rows, rows.new_zeros(padded_rows - n, rows.shape[1])])
    blocks = rows.view(-1, ROW_BLOCK, rows.shape[1])
    # One batched call of ROW_BLOCK-row products: the same kernel per block as one torch.mm of
    # ROW_BLOCK rows (bit for bit, any number of blocks), at the speed of one large product rather
    # than a call per block (HISTORY.md, "Where the time goes"). The weight is expanded, not
    # copied.
    weight_t = weight.t().unsqueeze(0).expand(blocks.shape[0], -1, -1)
    out = torch.bmm(blocks, weight_t).view(padded_rows, weight.shape[0])[:n]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


class RowInvariantLinear(nn.Linear):
    """`nn.Linear` whose rows do not depend on their batch on the CPU (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_invariant_linear(x, self.weight, self.bias)
