"""Per-step attention metadata: built once per step by the input builder, read by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CascadeMetadata:
    """The groups of this step whose shared prefix is attended once for all their query tokens.

    Queries of group g are the contiguous rows [group_cu_q[g], group_cu_q[g+1]) of the step's flat query
    tensor; padded (empty) groups have no rows.
    """

    group_cu_q: torch.Tensor  # [num_groups + 1] int32
    group_prefix_lens: torch.Tensor  # [num_groups] int32, multiples of the block size
    group_block_tables: torch.Tensor  # [num_groups, max_prefix_blocks] int32
    max_group_q: int  # rows of the largest group (a tile-shape hint for the prefix pass)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V is written to
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: KV length of each sequence after this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int
    kv_start: torch.Tensor | None = None  # [num_seqs] int32: first key of the suffix pass (cascade)
    cascade: CascadeMetadata | None = None


@dataclass
class SampledRows:
    """The rows of a step that end with a new token, which are all the model's last layer computes
    past its K/V projection: on a prefill chunk every other row only feeds that layer's keys and
    values, already in the cache once they are projected, so its attention, o_proj and MLP would be
    thrown away. Each sampled row is its sequence's last query, so `metadata` is decode-shaped: one
    query row per sampled sequence, same keys, same cascade groups (some of them empty)."""

    token_rows: torch.Tensor  # [num_sampled]: rows of the step's flat token tensor, in logits order
    metadata: AttentionMetadata
