"""Attention over the paged KV cache, through one of two implementations of the same kernels:
"triton" (the default on CUDA; on CPU it runs under TRITON_INTERPRET=1) and "torch" (plain references).

Rules both follow: the step's new K/V are in the cache before attention runs; query i of sequence s attends
keys [kv_start[s], its own position] of its block table, plus, when the step has cascade metadata and s is in
one of its groups, that group's whole prefix (attended once for all the group's queries); rows of padded
sequences may hold anything. Cascade steps take two passes (a prefix pass, then a suffix pass that merges
by log-sum-exp); with one_pass_decode, decode steps (one query per sequence) take the one-pass cascade
decode kernel instead, which streams a group's prefix and its requests' own keys through one program; with
fuse_suffix_chunks, the prefix pass of a step with prefill rows also finishes the suffix chunks (grouped
sequences with several queries: their own keys follow the prefix in the same online softmax), and the
suffix pass takes only the other rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .metadata import AttentionMetadata, SampledRows

# A prefix-pass tile hint (rows of the largest group) at or above the pass's widest tile.
WIDEST_TILE_HINT = 128


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    paged: Any  # paged_attention or its reference (prefixgrove_kernels.paged_attention)
    prefix: Any  # prefix_attention or its reference (prefixgrove_kernels.cascade_attention)
    # cascade_decode_attention or its reference (prefixgrove_kernels.cascade_decode) for decode steps;
    # None: decode steps take the two passes too
    decode: Any | None = None
    # SuffixChunks (prefixgrove_kernels.cascade_attention) when the prefix pass finishes the suffix
    # chunks of prefill steps; None: they take the suffix pass
    suffix_chunks: Any | None = None

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim]
        out = torch.empty_like(q)
        if q.shape[0] == 0:  # a last layer whose step samples nothing (prefix-only chunks)
            return out
        decode = self.decode
        if (
            decode is not None
            and meta.cascade is not None
            and meta.kv_start is not None
            and _is_decode(q, meta)
        ):
            c = meta.cascade
            decode(
                q,
                k_cache,
                v_cache,
                out,
                seq_lens=meta.seq_lens,
                kv_start=meta.kv_start,
                block_tables=meta.block_tables,
                group_cu_q=c.group_cu_q,
                group_prefix_lens=c.group_prefix_lens,
                group_block_tables=c.group_block_tables,
                scale=scale,
                max_group_q=c.max_group_q,
            )
            return out
        prefix_out = prefix_lse = chunks = None
        if meta.cascade is not None:
            c = meta.cascade
            make_chunks = self.suffix_chunks
            # With the fused form (Triton on CUDA), every step with prefill rows runs the pass in
            # one variant: fused, unsplit and in its widest tile, whatever its groups' sizes and
            # whether they hold suffix chunks at all. Its launches are long anyway, and each split
            # count, tile shape and form is a kernel variant of its own (a split one's reduce
            # another), which a job's odd steps (a few groups' decode rows beside a new prefix)
            # compiled mid-run: on a fresh machine the canonical job's first run lost ~1 s to the
            # unfused one. Elsewhere the tile stays what the groups ask for, so that a decode row's
            # arithmetic is the same in a mixed step as in a decode step.
            one_shape = make_chunks is not None and meta.max_query_len > 1
            fuse = one_shape and meta.kv_start is not None
            if make_chunks is not None and fuse:
                chunks = make_chunks(
                    out, meta.cu_seqlens_q, meta.seq_lens, meta.kv_start, meta.block_tables
                )
            # The prefix state in the model's dtype (lse in fp32), as FlashInfer keeps its cascade
            # states: on prefill chunks it is [tokens, heads, head_dim] written once and read
            # back once, half the bytes of fp32.
            prefix_out, prefix_lse = self.prefix(
                q,
                k_cache,
                v_cache,
                out=torch.empty_like(q),
                group_cu_q=c.group_cu_q,
                group_prefix_lens=c.group_prefix_lens,
                group_block_tables=c.group_block_tables,
                scale=scale,
                max_group_q=max(c.max_group_q, WIDEST_TILE_HINT) if one_shape else c.max_group_q,
                num_splits=1 if one_shape else None,
                suffix_chunks=chunks,
            )
        self.paged(
            q,
            k_cache,
            v_cache,
            out,
            cu_seqlens_q=meta.cu_seqlens_q,
            seq_lens=meta.seq_lens,
            block_tables=meta.block_tables,
            scale=scale,
            max_query_len=meta.max_query_len,
            kv_start=meta.kv_start,
            prefix_out=prefix_out,
            prefix_lse=prefix_lse,
            skip_suffix_chunks=chunks is not None,
        )
        return out


def _is_decode(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    """One query row per sequence (a host-side fact: no device read)."""
    return meta.max_query_len == 1 and q.shape[0] == meta.seq_lens.shape[0]


@dataclass
class ForwardContext:
    """What every attention layer needs in one step: the cache, the step's metadata and the backend."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v)
    metadata: AttentionMetadata
    backend: AttentionBackend
    # The rows the last layer narrows to; None: every row is sampled (decode) or the step keeps all
    sampled: SampledRows | None = None

    def __post_init__(self) -> None:
        self.slots = self.metadata.slot_mapping.long()  # once per step, not once per layer

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        scale: float,
        metadata: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """q's attention over the layer's cache, which already holds this step's keys and values
        (written to `slots` by the model's rotary kernel); q's rows are the step's, or those that
        `metadata` describes (the sampled rows' decode-shaped metadata)."""
        k_cache, v_cache = self.kv_caches[layer]
        return self.backend.forward(q, k_cache, v_cache, metadata or self.metadata, scale)


def create_backend(
    name: str, *, one_pass_decode: bool = False, fuse_suffix_chunks: bool = False
) -> AttentionBackend:
    from prefixgrove_kernels import cascade_attention as cascade
    from prefixgrove_kernels import cascade_decode as decode
    from prefixgrove_kernels import paged_attention as paged

    chunks = cascade.SuffixChunks if fuse_suffix_chunks else None

    if name == "triton":
        return AttentionBackend(
            "triton",
            paged.paged_attention,
            cascade.prefix_attention,
            decode.cascade_decode_attention if one_pass_decode else None,
            chunks,
        )
    if name == "torch":
        return AttentionBackend(
            "torch",
            paged.paged_attention_ref,
            cascade.prefix_attention_ref,
            decode.cascade_decode_attention_ref if one_pass_decode else None,
            chunks,
        )
    raise ValueError(f"attention_backend={name!r} is unknown; expected 'triton' or 'torch'")
