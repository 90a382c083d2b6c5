"""Structured outputs' token masks applied to a step's logits: one launch for every constrained row.

A mask row holds one bit per token id (bit t % 32 of word t // 32, llguidance's and xgrammar's layout);
a token whose bit is clear gets -inf. Rows without a mask are not touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgrove_kernels import checks
from prefixgrove_kernels.launch import KernelLaunch

BLOCK_V = 4096


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,  # [n, vocab] fp32 (row stride free)
    bitmask_ptr,  # [k, words] int32
    rows_ptr,  # [k] int64: the logits row of mask row i
    vocab,
    logits_stride,
    words,
    BLOCK_V: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = cols < vocab
    word = tl.load(bitmask_ptr + i.to(tl.int64) * words + cols // 32, mask=inside, other=0)
    allowed = ((word >> (cols % 32)) & 1) != 0
    tl.store(logits_ptr + row * logits_stride + cols, float("-inf"), mask=inside & ~allowed)


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    checks.check_tensor(
        "logits", logits, ndim=2, dtypes=(torch.float32,), device=logits.device, contiguous=False
    )
    checks.check_unit_last_stride("logits", logits)
    checks.check_tensor("bitmask", bitmask, ndim=2, dtypes=(torch.int32,), device=logits.device)
    checks.check_tensor("rows", rows, ndim=1, dtypes=(torch.int64,), device=logits.device)
    if bitmask.shape[0] != rows.shape[0]:
        raise ValueError(
            f"bitmask has {bitmask.shape[0]} rows but rows names {rows.shape[0]} logits rows"
        )
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(
            f"bitmask of {bitmask.shape[1]} words covers {bitmask.shape[1] * 32} token ids, fewer "
            f"than the {logits.shape[1]} logits"
        )


def apply_token_bitmask_launch(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> KernelLaunch | None:
    """Checks the arguments and plans the launch `apply_token_bitmask` makes."""
    _check(logits, bitmask, rows)
    k, vocab = rows.shape[0], logits.shape[1]
    if k == 0 or vocab == 0:
        return None
    block = min(BLOCK_V, triton.next_power_of_2(vocab))
    grid = (k, triton.cdiv(vocab, block))
    args = (logits, bitmask.contiguous(), rows, vocab, logits.stride(0), bitmask.shape[1])
    return KernelLaunch(_apply_token_bitmask_kernel, grid, args, {"BLOCK_V": block, "num_warps": 4})


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask[i] is clear, in place."""
    launch = apply_token_bitmask_launch(logits, bitmask, rows)
    if launch is not None:
        launch.run()


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """Torch version of `apply_token_bitmask` (the engine's path on the CPU)."""
    _check(logits, bitmask, rows)
    if rows.numel() == 0:
        return
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [k, words, 32]
    allowed = bits.flatten(1)[:, : logits.shape[1]].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
