"""The machine's read ceiling: how long a plain streaming read of N contiguous bytes takes.

An attention kernel that must read N bytes of KV cache cannot beat a kernel that only reads N
contiguous bytes and adds them up. attention_kernels.py times that read for the one-pass kernel's
bytes beside it, so its figures carry their own bound: the fraction of the ceiling the kernel reaches,
and the most any kernel reading those bytes could gain over the plain one. The bound is on bytes,
whatever they hold: an FP8 cache's bytes (one a value) are read here as bf16 elements, as a bf16
cache's are. The read is timed as the kernels are (a CUDA graph, from a cold, clean L2) under a few
launch shapes, and the fastest counts: on the H100 four programs per SM of 4,096-element blocks and
two of 8,192, at a few hundred MB (benchmarks/HISTORY.md, "Decode attention kernels").
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from _common import median_us_clean_l2

# (programs per SM, elements per load, warps, stages)
LAUNCH_SHAPES = ((4, 4096, 4, 3), (2, 8192, 8, 3), (8, 2048, 4, 4))


@triton.jit
def _stream_read_kernel(x_ptr, out_ptr, per_program, BLOCK: tl.constexpr):
    """Program p adds up elements [p * per_program, (p + 1) * per_program) by lanes into out[p]
    (a sum that depends on every load, so no load can be dropped)."""
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], tl.float32)
    for offset in range(0, per_program, BLOCK):
        acc += tl.load(base + offset + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


def per_program_elements(numel: int, programs: int, block: int) -> int:
    """Elements each program reads of a flat tensor of numel: a whole number of blocks."""
    per_program = numel // programs // block * block
    if per_program == 0:
        raise ValueError(f"{numel} elements are fewer than {programs} programs x {block}")
    return per_program


def stream_read(
    x: torch.Tensor, programs: int, block: int, warps: int = 4, stages: int = 3
) -> torch.Tensor:
    """Reads the first programs * per_program_elements(...) elements of the flat tensor x; returns
    each program's lane sums [programs, block] (fp32)."""
    per_program = per_program_elements(x.numel(), programs, block)
    out = torch.empty((programs, block), dtype=torch.float32, device=x.device)
    grid = (programs,)
    _stream_read_kernel[grid](x, out, per_program, BLOCK=block, num_warps=warps, num_stages=stages)
    return out


def read_ceiling_us(nbytes: int, device: str) -> float:
    """Microseconds of the fastest streaming read of nbytes (bf16 elements) on the GPU, timed as
    median_us_clean_l2 times the kernels, scaled up to exactly nbytes (a launch shape reads a whole
    number of blocks per program, a little less than asked). Small sizes take fewer programs and read
    at least one whole block (smoke runs: what bounds a tiny read is the launch, not bandwidth)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    largest_block = max(block for _, block, _, _ in LAUNCH_SHAPES)
    x = torch.ones(max(nbytes // 2, largest_block), dtype=torch.bfloat16, device=device)
    best = float("inf")
    for per_sm, block, warps, stages in LAUNCH_SHAPES:
        programs = min(per_sm * sms, x.numel() // block)
        read = programs * per_program_elements(x.numel(), programs, block) * 2
        run = functools.partial(stream_read, x, programs, block, warps, stages)
        us = median_us_clean_l2(run, device, use_graph=True)
        best = min(best, us * max(1.0, nbytes / read))  # padded tiny reads: not scaled down
    return best
