"""A step's (token, choice) pairs sorted by expert for `fused_moe`'s grouped GEMMs, on the device
(vLLM's moe_align_block_size): each expert's pairs form one run, padded to a multiple of the GEMMs'
BLOCK_M, so that every block of BLOCK_M rows belongs to one expert.

Pair p = token * top_k + j is the token's j-th choice, expert topk_ids.view(-1)[p].

| output          | shape                          | holds                                           |
|-----------------|--------------------------------|-------------------------------------------------|
| sorted_pair_ids | [max_blocks * block_m] int32   | the pairs by expert (by p within one expert);   |
|                 |                                | a run's padding slots hold num_pairs            |
| block_experts   | [max_blocks] int32             | each block's expert; -1 from num_padded on      |
| num_padded      | [1] int32                      | the slots in use: each run rounded up to block_m |

max_blocks is a bound the host knows without reading the ids: only experts that hold pairs pad
their runs, so num_padded <= pairs + min(experts, pairs) * (block_m - 1). The slots from num_padded
on are left unwritten; the GEMMs stop at num_padded.

Three launches, no loop over experts and no wait for the device: a histogram of experts per chunk
of pairs; one program turning the histograms into each chunk's first slot in each expert's run, each
run's start, the padding and block_experts; and one program per chunk writing its pairs into their
slots. Expert ids outside [0, experts) are a caller's bug: their pairs are never placed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from prefixgrove_kernels import checks
from prefixgrove_kernels.launch import KernelLaunch

ID_DTYPES = (torch.int32, torch.int64)
TILE_ELEMENTS = 8192  # a program's one-hot tile: pairs (or histogram rows) x BLOCK_E
MAX_CHUNK = 256
BLOCK_B = 256  # blocks per step of the offsets program's block_experts loop


class MoeAlignment(NamedTuple):
    sorted_pair_ids: torch.Tensor  # [max_blocks * block_m] int32
    block_experts: torch.Tensor  # [max_blocks] int32
    num_padded: torch.Tensor  # [1] int32
    block_m: int


@triton.jit
def _expert_hits(ids_ptr, chunk, num_pairs, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """The chunk's pairs and their one-hot experts: hits [CHUNK, BLOCK_E] int32 (a pair past the
    end, or with an id out of range, has none)."""
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
    ids = tl.where((ids >= 0) & (ids < E), ids, -1)
    hits = (ids[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)
    return pairs, ids, hits


@triton.jit
def _count_kernel(
    ids_ptr,  # [num_pairs] int32 or int64
    counts_ptr,  # [num_chunks, E] int32 out: each chunk's pairs per expert
    num_pairs,
    E,
    CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    chunk = tl.program_id(0)
    _, _, hits = _expert_hits(ids_ptr, chunk, num_pairs, E, CHUNK, BLOCK_E)
    experts = tl.arange(0, BLOCK_E)
    tl.store(counts_ptr + chunk * E + experts, tl.sum(hits, axis=0), mask=experts < E)


@triton.jit
def _offsets_kernel(
    counts_ptr,  # [num_chunks, E] int32, in: counts; out: each chunk's first slot in each run
    run_starts_ptr,  # [E] int32 out: each expert's first slot
    sorted_ptr,  # [max_blocks * BLOCK_M] int32 out: the padding slots (num_pairs)
    block_experts_ptr,  # [max_blocks] int32 out
    num_padded_ptr,  # [1] int32 out
    num_chunks,
    num_pairs,
    E,
    max_blocks,
    BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    in_e = experts < E
    totals = tl.zeros([BLOCK_E], dtype=tl.int32)
    for r0 in range(0, num_chunks, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        mask = (rows < num_chunks)[:, None] & in_e[None, :]
        ptrs = counts_ptr + rows[:, None] * E + experts[None, :]
        counts = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(counts, axis=0) - counts + totals[None, :], mask=mask)
        totals += tl.sum(counts, axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_ends = tl.cumsum(padded, axis=0)
    run_starts = run_ends - padded
    tl.store(run_starts_ptr + experts, run_starts, mask=in_e)
    num_padded = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, num_padded)
    pad_slots = (run_starts + totals)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    pad_mask = in_e[:, None] & (pad_slots < run_ends[:, None])
    tl.store(sorted_ptr + pad_slots, tl.zeros_like(pad_slots) + num_pairs, mask=pad_mask)
    # a block's expert: the number of runs that end at or before its first slot
    run_ends = tl.where(in_e, run_ends, 2147483647)
    for b0 in range(0, max_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        first_slots = blocks * BLOCK_M
        expert = tl.sum((run_ends[None, :] <= first_slots[:, None]).to(tl.int32), axis=1)
        expert = tl.where(first_slots < num_padded, expert, -1)
        tl.store(block_experts_ptr + blocks, expert, mask=blocks < max_blocks)


@triton.jit
def _place_kernel(
    ids_ptr,  # [num_pairs] int32 or int64
    chunk_starts_ptr,  # [num_chunks, E] int32: each chunk's first slot in each run
    run_starts_ptr,  # [E] int32
    sorted_ptr,  # [max_blocks * BLOCK_M] int32 out: the pairs
    num_pairs,
    E,
    CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    chunk = tl.program_id(0)
    pairs, ids, hits = _expert_hits(ids_ptr, chunk, num_pairs, E, CHUNK, BLOCK_E)
    placed = ids >= 0
    earlier_same = tl.sum((tl.cumsum(hits, axis=0) - hits) * hits, axis=1)
    chunk_start = tl.load(chunk_starts_ptr + chunk * E + ids, mask=placed, other=0)
    run_start = tl.load(run_starts_ptr + ids, mask=placed, other=0)
    tl.store(sorted_ptr + run_start + chunk_start + earlier_same, pairs, mask=placed)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """How many blocks of block_m slots the padded runs of num_pairs pairs may take."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


def _check(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    checks.check_tensor("topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES, device=topk_ids.device)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if not checks.is_power_of_two(block_m):
        raise ValueError(f"block_m must be a power of two, got {block_m!r}")


def moe_align_launches(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[list[KernelLaunch], MoeAlignment]:
    """Checks the arguments and plans the three launches `moe_align` makes, in order."""
    _check(topk_ids, num_experts, block_m)
    num_pairs, ints = topk_ids.numel(), topk_ids.new_empty(0, dtype=torch.int32)
    blocks = max_blocks(num_pairs, num_experts, block_m)
    out = MoeAlignment(
        ints.new_empty(blocks * block_m), ints.new_empty(blocks), ints.new_zeros(1), block_m
    )
    if num_pairs == 0:
        return [], out
    block_e = triton.next_power_of_2(num_experts)
    chunk = max(16, min(MAX_CHUNK, TILE_ELEMENTS // block_e, triton.next_power_of_2(num_pairs)))
    num_chunks = triton.cdiv(num_pairs, chunk)
    counts, run_starts = ints.new_empty((num_chunks, num_experts)), ints.new_empty(num_experts)
    ids, per_chunk = topk_ids.view(-1), {"CHUNK": chunk, "BLOCK_E": block_e}
    offsets_options = {
        "BLOCK_M": block_m, "BLOCK_E": block_e,
        "ROWS": max(1, min(TILE_ELEMENTS // block_e, triton.next_power_of_2(num_chunks))),
        "BLOCK_B": min(BLOCK_B, triton.next_power_of_2(blocks)),
    }  # fmt: skip
    offsets_args = (
        counts, run_starts, out.sorted_pair_ids, out.block_experts, out.num_padded, num_chunks,
        num_pairs, num_experts, blocks,
    )  # fmt: skip
    place_args = (ids, counts, run_starts, out.sorted_pair_ids, num_pairs, num_experts)
    count_args = (ids, counts, num_pairs, num_experts)
    return [
        KernelLaunch(_count_kernel, (num_chunks,), count_args, per_chunk),
        KernelLaunch(_offsets_kernel, (1,), offsets_args, offsets_options),
        KernelLaunch(_place_kernel, (num_chunks,), place_args, per_chunk),
    ], out


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """topk_ids [tokens, top_k] (int32 or int64, contiguous) -> the pairs sorted by expert in runs
    padded to block_m (a power of two); see the module docstring."""
    launches, out = moe_align_launches(topk_ids, num_experts, block_m)
    for launch in launches:
        launch.run()
    return out


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Torch version of `moe_align` (a stable sort); the slots from num_padded on hold num_pairs."""
    _check(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1).long()
    num_pairs, blocks = flat.numel(), max_blocks(flat.numel(), num_experts, block_m)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    run_starts, unpadded_starts = padded.cumsum(0) - padded, counts.cumsum(0) - counts
    experts = flat[order]
    slots = (
        run_starts[experts] + torch.arange(num_pairs, device=flat.device) - unpadded_starts[experts]
    )
    sorted_ids = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[slots] = order.to(torch.int32)
    block_experts = torch.full((blocks,), -1, dtype=torch.int32, device=flat.device)
    runs = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_m)
    block_experts[: runs.numel()] = runs.to(torch.int32)
    num_padded = padded.sum().reshape(1).to(torch.int32)
    return MoeAlignment(sorted_ids, block_experts, num_padded, block_m)
