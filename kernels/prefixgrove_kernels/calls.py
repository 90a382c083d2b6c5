"""A kernel call's parameters, written once: the launch planner, the function that runs the launch
and the torch reference of a kernel take the same arguments, so one of them (or a record of them)
holds the parameter list and the others take it over (`takes_arguments_of`).

The attention kernels' records share `AttentionCall`: the queries, the paged cache (in q's dtype, or
FP8 with k_scale and v_scale), the softmax scale and a layer's score shaping: `softcap` (Gemma 2's
attention-logit soft-capping: a score x becomes softcap * tanh(x / softcap), 0 for none) and
`window` (a sliding window: the query at position p sees keys k with p - k < window, 0 for all);
each kernel's docstring explains the rest.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import ParamSpec, TypeVar

import torch

from prefixgrove_kernels import checks
from prefixgrove_kernels.launch import CascadeMetadata, PagedMetadata, SuffixChunks

P = ParamSpec("P")
R = TypeVar("R")


def takes_arguments_of(source: Callable[P, object]) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """Gives a function that passes its arguments on (`*args, **kwargs`) the parameters of `source`,
    a call record or a launch planner, for its callers, type checkers and help()."""

    def typed(fn: Callable[..., R]) -> Callable[P, R]:
        returns = inspect.signature(fn).return_annotation
        signature = inspect.signature(source).replace(return_annotation=returns)
        fn.__signature__ = signature  # type: ignore[attr-defined]
        return fn

    return typed


@dataclass(frozen=True, eq=False, slots=True)
class AttentionCall:
    """What every attention kernel's call takes (each kernel's record adds its own arguments)."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    _: KW_ONLY
    scale: float
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    softcap: float = 0.0
    window: int = 0

    def check(self, kernel: bool) -> tuple[int, tuple[torch.Tensor, torch.Tensor]]:
        """Checks what every attention kernel takes; returns (the GQA ratio, the launch's scale
        arguments: `checks.kv_scale_args`). kernel: as `checks.check_queries`."""
        checks.check_queries(self.q, kernel)
        group = checks.check_kv_cache(self.q, self.k_cache, self.v_cache)
        scales = checks.kv_scale_args(self.q.device, self.k_cache, self.k_scale, self.v_scale)
        checks.check_scale(self.scale)
        checks.check_score_shaping(self.softcap, self.window)
        return group, scales


@dataclass(frozen=True, eq=False, slots=True)
class PagedCall(AttentionCall):
    """`paged_attention.paged_attention`'s arguments."""

    out: torch.Tensor
    meta: PagedMetadata
    _: KW_ONLY
    prefix_out: torch.Tensor | None = None
    prefix_lse: torch.Tensor | None = None
    skip_suffix_chunks: bool = False


@dataclass(frozen=True, eq=False, slots=True)
class PrefixCall(AttentionCall):
    """`cascade_attention.prefix_attention`'s arguments."""

    groups: CascadeMetadata
    _: KW_ONLY
    out: torch.Tensor | None = None
    out_lse: torch.Tensor | None = None
    num_splits: int | None = None
    suffix_chunks: SuffixChunks | None = None
    tile_rows: int | None = None
    # The step's sequences as the paged kernel takes them (rows as q's), which give each row its
    # position: needed with a window (suffix_chunks' seqs serve when given)
    query_seqs: PagedMetadata | None = None


@dataclass(frozen=True, eq=False, slots=True)
class DecodeCall(AttentionCall):
    """`cascade_decode.cascade_decode_attention`'s arguments."""

    out: torch.Tensor
    meta: PagedMetadata
    groups: CascadeMetadata
    _: KW_ONLY
    num_splits: int | None = None
