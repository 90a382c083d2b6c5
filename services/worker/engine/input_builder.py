"""Turns a scheduled batch into the step's device inputs: flat arrays packed into one pinned host buffer
and moved to the device with a single copy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .attention.metadata import AttentionMetadata, CascadeMetadata
from .scheduler import ScheduledSeq

# A group's shared prefix is attended in a separate pass only when that pays: reading it once for many
# queries must outweigh one more pass over the queries and the merge.
CASCADE_MIN_SEQS = 2
CASCADE_MIN_PREFIX = 64


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    logits_indices: torch.Tensor  # [num_sampled]: rows of the hidden states that produce a token
    metadata: AttentionMetadata
    num_tokens: int
    order: list[ScheduledSeq]  # the batch in the order its rows were laid out


class InputBuilder:
    def __init__(self, block_size: int, device: torch.device, use_cascade: bool) -> None:
        self.block_size = block_size
        self.device = device
        self.use_cascade = use_cascade
        self._pin = device.type == "cuda"

    def build(self, batch: list[ScheduledSeq]) -> StepInputs:
        batch, cascade_groups = self._order(batch)
        arrays, host_ints = self._host_arrays(batch, cascade_groups)
        names = list(arrays)
        sizes = [arrays[n].size for n in names]
        flat = np.concatenate([arrays[n].ravel() for n in names]).astype(np.int32, copy=False)
        host = torch.from_numpy(flat)
        if self._pin:
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)  # the step's one host-to-device copy
        views, offset = {}, 0
        for n, size in zip(names, sizes, strict=True):
            views[n] = dev[offset: offset + size].view(arrays[n].shape)
            offset += size
        return self._assemble(views, host_ints, batch, bool(cascade_groups))

    def _order(self, batch: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[range]]:
        """Lays the cascade groups' rows out first, each group contiguous and back to back (the prefix pass
        addresses a group's queries as one range), then every other row in scheduler order."""
        if not self.use_cascade:
            return batch, []
        members: dict[int, list[ScheduledSeq]] = {}
        for item in batch:
            if item.seq.shared_prefix_len >= CASCADE_MIN_PREFIX:
                members.setdefault(id(item.seq.group), []).append(item)
        chosen = [m for m in members.values() if len(m) >= CASCADE_MIN_SEQS]
        in_groups = {id(item) for m in chosen for item in m}
        ordered = [item for m in chosen for item in m]
        ordered += [item for item in batch if id(item) not in in_groups]
        ranges, start = [], 0
        for m in chosen:
            ranges.append(range(start, start + len(m)))
            start += len(m)
        return ordered, ranges

    def _host_arrays(self, batch: list[ScheduledSeq], groups: list[range]):
        n = len(batch)
        q_lens = np.array([b.num_tokens for b in batch], dtype=np.int64)
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        total = int(cu[-1])
        max_blocks = max(len(b.seq.block_table) for b in batch)
        block_tables = np.zeros((n, max_blocks), dtype=np.int64)
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        seq_lens = np.empty(n, dtype=np.int64)
        kv_start = np.zeros(n, dtype=np.int64)
        cascade_rows = groups[-1].stop if groups else 0
        for i, item in enumerate(batch):
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            input_ids[cu[i]: cu[i + 1]] = seq.token_ids(start, end)
            positions[cu[i]: cu[i + 1]] = np.arange(start, end)
            seq_lens[i] = end
            block_tables[i, : len(seq.block_table)] = seq.block_table
            if i < cascade_rows:
                kv_start[i] = seq.shared_prefix_len
        bs = self.block_size
        rows_of_token = np.repeat(np.arange(n), q_lens)
        slot_mapping = block_tables[rows_of_token, positions // bs] * bs + positions % bs
        sampled = [i for i, b in enumerate(batch) if b.sample]
        logits_indices = cu[1:][sampled] - 1
        arrays = {"input_ids": input_ids, "positions": positions, "slot_mapping": slot_mapping,
                  "cu_seqlens_q": cu, "seq_lens": seq_lens, "block_tables": block_tables,
                  "logits_indices": logits_indices, "kv_start": kv_start}
        host_ints = {"max_query_len": int(q_lens.max()), "num_tokens": total}
        if groups:
            arrays.update(self._cascade_arrays(batch, groups, cu))
            host_ints["max_group_q"] = max(int(cu[r.stop] - cu[r.start]) for r in groups)
        return arrays, host_ints

    def _cascade_arrays(self, batch: list[ScheduledSeq], groups: list[range], cu: np.ndarray):
        firsts = [batch[r.start].seq for r in groups]
        width = max(s.num_shared_blocks for s in firsts)
        tables = np.zeros((len(groups), width), dtype=np.int64)
        for g, seq in enumerate(firsts):
            tables[g, : seq.num_shared_blocks] = seq.block_table[: seq.num_shared_blocks]
        return {"group_cu_q": cu[[0] + [r.stop for r in groups]],
                "group_prefix_lens": np.array([s.shared_prefix_len for s in firsts], dtype=np.int64),
                "group_block_tables": tables}

    def _assemble(self, v: dict[str, torch.Tensor], host_ints: dict[str, int],
                  order: list[ScheduledSeq], cascade: bool) -> StepInputs:
        cascade_meta = None
        if cascade:
            cascade_meta = CascadeMetadata(
                group_cu_q=v["group_cu_q"],
                group_prefix_lens=v["group_prefix_lens"], group_block_tables=v["group_block_tables"],
                max_group_q=host_ints["max_group_q"])
        meta = AttentionMetadata(
            slot_mapping=v["slot_mapping"].long(), cu_seqlens_q=v["cu_seqlens_q"], seq_lens=v["seq_lens"],
            block_tables=v["block_tables"], max_query_len=host_ints["max_query_len"],
            kv_start=v["kv_start"] if cascade else None, cascade=cascade_meta)
        return StepInputs(input_ids=v["input_ids"].long(), positions=v["positions"].long(),
                          logits_indices=v["logits_indices"].long(), metadata=meta,
                          num_tokens=host_ints["num_tokens"], order=order)
