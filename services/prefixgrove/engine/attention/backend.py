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

With an FP8 KV cache (kv_cache.py) every kernel takes the layer's k_scale and v_scale beside the cache.

A layer may shape its scores (Gemma): `softcap` caps them by tanh, `window` limits each query to the
last `window` positions up to its own, in every pass (the prefix pass masks a group's prefix keys
that fall outside a row's window). A windowed layer's cache keeps all of a sequence's blocks: the
window masks the keys before it, so the blocks, the prefix cache and the groups are shared with the
model's global layers, which need them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from prefixgrove_kernels.launch import CascadeMetadata, SuffixChunks

from .kv_cache import LayerCache, unpack
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
    # The prefix pass finishes the suffix chunks of prefill steps; False: they take the suffix pass
    fuse_suffix_chunks: bool = False

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        softcap: float = 0.0,
        window: int = 0,
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim]
        # in q's dtype, or FP8 with k_scale and v_scale
        out = torch.empty_like(q)
        if q.shape[0] == 0:  # a last layer whose step samples nothing (prefix-only chunks)
            return out
        scales: dict[str, Any] = {"k_scale": k_scale, "v_scale": v_scale}
        if softcap or window:  # keyword arguments only where set: the Llama path calls as before
            scales |= {"softcap": softcap, "window": window}
        groups = meta.cascade
        if groups is None:
            self.paged(q, k_cache, v_cache, out, meta, scale=scale, **scales)
        elif self.decode is not None and meta.kv_start is not None and _is_decode(q, meta):
            self.decode(q, k_cache, v_cache, out, meta, groups, scale=scale, **scales)
        else:
            self._two_passes(q, k_cache, v_cache, out, meta, groups, scale, scales)
        return out

    def _two_passes(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        meta: AttentionMetadata,
        groups: CascadeMetadata,
        scale: float,
        scales: dict[str, Any],
    ) -> None:
        """The prefix pass, then the suffix pass that merges its state (writes `out`)."""
        # With the fused form (Triton on CUDA), every step with prefill rows runs the prefix pass in
        # one variant: fused, unsplit and in its widest tile, whatever its groups' sizes and
        # whether they hold suffix chunks at all. Its launches are long anyway, and each split
        # count, tile shape and form is a kernel variant of its own (a split one's reduce another),
        # which a job's odd steps (a few groups' decode rows beside a new prefix) would compile
        # mid-run. Elsewhere the tile stays what the groups ask for, so that a decode row's
        # arithmetic is the same in a mixed step as in a decode step.
        one_shape = self.fuse_suffix_chunks and meta.max_query_len > 1
        chunks = None
        # A window masks prefix keys by each row's position, which the step's sequences give.
        rows = {"query_seqs": meta} if scales.get("window") else {}
        if one_shape and meta.kv_start is not None:
            chunks = SuffixChunks(out, meta)
        # The prefix state in the model's dtype (lse in fp32), as FlashInfer keeps its cascade
        # states: on prefill chunks it is [tokens, heads, head_dim] written once and read back
        # once, half the bytes of fp32.
        prefix_out, prefix_lse = self.prefix(
            q, k_cache, v_cache, groups, scale=scale, out=torch.empty_like(q),
            num_splits=1 if one_shape else None, suffix_chunks=chunks,
            tile_rows=max(groups.max_group_q, WIDEST_TILE_HINT) if one_shape else None, **scales,
            **rows,
        )  # fmt: skip
        self.paged(
            q, k_cache, v_cache, out, meta, scale=scale, prefix_out=prefix_out,
            prefix_lse=prefix_lse, skip_suffix_chunks=chunks is not None, **scales,
        )  # fmt: skip


def _is_decode(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    """One query row per sequence (a host-side fact: no device read)."""
    return meta.max_query_len == 1 and q.shape[0] == meta.seq_lens.shape[0]


@dataclass
class ForwardContext:
    """What every attention layer needs in one step: the cache, the step's metadata and the backend."""

    kv_caches: list[tuple[LayerCache, LayerCache]]  # per layer (k, v)
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
        softcap: float = 0.0,
        window: int = 0,
    ) -> torch.Tensor:
        """q's attention over the layer's cache, which already holds this step's keys and values
        (written to `slots` by the model's rotary kernel); q's rows are the step's, or those that
        `metadata` describes (the sampled rows' decode-shaped metadata). softcap and window: the
        layer's score shaping (0: none), as the kernels take them."""
        (k_cache, k_scale), (v_cache, v_scale) = map(unpack, self.kv_caches[layer])
        meta = metadata or self.metadata
        return self.backend.forward(
            q, k_cache, v_cache, meta, scale, k_scale, v_scale, softcap, window
        )


def create_backend(
    name: str, *, one_pass_decode: bool = False, fuse_suffix_chunks: bool = False
) -> AttentionBackend:
    from prefixgrove_kernels import cascade_attention as cascade
    from prefixgrove_kernels import cascade_decode as decode
    from prefixgrove_kernels import paged_attention as paged

    # name: (paged attention, prefix pass, one-pass decode), the fast path or its reference
    paths = {
        "triton": (
            paged.paged_attention,
            cascade.prefix_attention,
            decode.cascade_decode_attention,
        ),
        "torch": (
            paged.paged_attention_ref,
            cascade.prefix_attention_ref,
            decode.cascade_decode_attention_ref,
        ),
    }
    if name in paths:
        paged_fn, prefix_fn, one_pass_fn = paths[name]
        one_pass = one_pass_fn if one_pass_decode else None
        return AttentionBackend(name, paged_fn, prefix_fn, one_pass, fuse_suffix_chunks)
    raise ValueError(f"attention_backend={name!r} is unknown; expected 'triton' or 'torch'")
