"""What the attention launchers take and plan: a step's metadata as typed objects, and a kernel launch
as data, so it can be run, compiled ahead of time or captured in a CUDA graph.

The metadata objects hold device tensors and host ints only; a launcher reads their shapes and ints,
never their values, so the engine builds them once per step over static buffers and every layer (and
every replay of a captured step) reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


@dataclass(frozen=True, kw_only=True)
class PagedMetadata:
    """A step's sequences: sequence s owns query rows [cu_seqlens_q[s], cu_seqlens_q[s + 1]) and
    attends keys [kv_start[s], its own position] through block_tables[s]."""

    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: KV length of each sequence after this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 (row stride free)
    max_query_len: int  # >= every sequence's query count (a tile-shape hint; padding is fine)
    # [num_seqs] int32: a grouped sequence's first own key (its group's prefix length, 0 outside
    # groups); None: every sequence attends from key 0
    kv_start: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True)
class CascadeMetadata:
    """The groups whose shared prefix is attended once for all their query rows: group g owns the
    contiguous rows [group_cu_q[g], group_cu_q[g + 1]); padded (empty) groups have none."""

    group_cu_q: torch.Tensor  # [num_groups + 1] int32
    group_prefix_lens: torch.Tensor  # [num_groups] int32 (whole blocks in the engine; any works)
    group_block_tables: torch.Tensor  # [num_groups, max_prefix_blocks] int32
    max_group_q: int  # rows of the largest group: picks tile shapes and split counts only


class SuffixChunks(NamedTuple):
    """The step's sequences as the paged kernel takes them, and the attention output: given to the
    prefix pass, it finishes the suffix chunks among them (grouped sequences with more than one
    query: `paged_attention.is_suffix_chunk`) and writes their rows of `out`, which the paged
    kernel then skips."""

    out: torch.Tensor  # [num_tokens, num_heads, head_dim], q's dtype (token, head strides free)
    seqs: PagedMetadata  # with kv_start


class KernelLaunch(NamedTuple):
    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    options: dict[str, Any]  # constexprs, num_warps, num_stages

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.options)

    def compile(self) -> Any:
        """Compiles for the active Triton target without launching (tests, warm-up)."""
        return self.kernel.warmup(*self.args, grid=self.grid, **self.options)
