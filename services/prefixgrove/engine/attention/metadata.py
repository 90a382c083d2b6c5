"""Per-step attention metadata: built once per step by the input builder, read by every layer.

The step's sequences are the kernels' own `PagedMetadata` (so every launcher takes this object as
it is, with nothing to rebuild per layer) plus the cache slots of the step's new keys and values,
and the prefix groups of a cascade step (`CascadeMetadata`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixgrove_kernels.launch import CascadeMetadata, PagedMetadata

__all__ = ["AttentionMetadata", "CascadeMetadata", "SampledRows"]


@dataclass(frozen=True, kw_only=True)
class AttentionMetadata(PagedMetadata):
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V is written to
    cascade: CascadeMetadata | None = None  # None: no prefix groups (kv_start is None then too)


@dataclass
class SampledRows:
    """The rows of a step that end with a new token, which are all the model's last layer computes
    past its K/V projection: on a prefill chunk every other row only feeds that layer's keys and
    values, already in the cache once they are projected, so its attention, o_proj and MLP would be
    thrown away. Each sampled row is its sequence's last query, so `metadata` is decode-shaped: one
    query row per sampled sequence, same keys, same cascade groups (some of them empty)."""

    token_rows: torch.Tensor  # [num_sampled]: rows of the step's flat token tensor, in logits order
    metadata: AttentionMetadata
