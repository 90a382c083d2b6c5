"""Turns a scheduled batch into the step's device inputs.

Every per-step array lives in one fixed "arena": a pinned host buffer and its device twin, each cut into
regions sized for the largest step. A step fills the host regions and moves them with a single host-to-device
copy; the device regions never move, so CUDA graphs captured on views of them replay with new contents.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..attention.metadata import AttentionMetadata, CascadeMetadata, SampledRows
from ..core.sequence import ScheduledSeq

# A group's shared prefix is attended in a separate pass only when that pays: reading it once for many
# queries must outweigh one more pass over the queries and the merge.
CASCADE_MIN_SEQS = 2
CASCADE_MIN_PREFIX = 64


# Every region starts a multiple of 16 bytes into the buffer: Triton specialises a kernel on whether
# each pointer is 16-byte aligned, so a region's alignment must not depend on the sizes of the ones
# before it (the decode kernel fed from regions aligned otherwise than its graphs' compiled a second
# variant in the middle of a job).
_REGION_ALIGN = 4  # int32 elements


def _bucket(n: int) -> int:
    """Rounds a host bound up to a power of two: kernels specialise on these bounds, and a handful of
    buckets keeps Triton from compiling a new variant for every batch shape."""
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class StepShape:
    """The host-side sizes that cut a step's views out of the arena: with the arena's contents, all
    a tensor-parallel follower needs to run the step as rank 0 laid it out."""

    num_tokens: int
    rows: int
    num_sampled: int
    real_groups: int
    num_groups: int
    max_query_len: int
    max_group_q: int
    cascade: bool
    # the most sampled rows of one group when the last layer narrows to the sampled rows, else None
    sampled_group_q: int | None = None

    def unnarrowed(self) -> StepShape:
        return replace(self, sampled_group_q=None)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int32
    positions: torch.Tensor  # [num_tokens] int32
    logits_indices: torch.Tensor  # [num_sampled]: rows of the hidden states that produce a token
    metadata: AttentionMetadata
    order: list[ScheduledSeq]  # the batch in the order its rows were laid out
    shape: StepShape
    # What the last layer narrows to when some rows produce no token (prefill chunks); None when
    # every row is sampled (decode steps)
    sampled: SampledRows | None = None


class _Arena:
    """Named int32 regions over one pinned host buffer and one device buffer of the same layout."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: torch.device) -> None:
        self.shapes, self.offsets, size = shapes, {}, 0
        for name, shape in shapes.items():
            self.offsets[name] = size
            size += -(-int(np.prod(shape)) // _REGION_ALIGN) * _REGION_ALIGN
        pin = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.device = torch.zeros(size, dtype=torch.int32, device=device)
        self._uploaded: torch.cuda.Event | None = None

    def host_view(self, name: str) -> np.ndarray:
        start = self.offsets[name]
        return self.host_np[start : start + int(np.prod(self.shapes[name]))].reshape(
            self.shapes[name]
        )

    def device_view(self, name: str) -> torch.Tensor:
        start = self.offsets[name]
        return self.device[start : start + int(np.prod(self.shapes[name]))].view(self.shapes[name])

    def upload(self) -> None:
        self.device.copy_(self.host, non_blocking=True)  # the step's one host-to-device copy
        if self.device.is_cuda:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()

    def wait_for_upload(self) -> None:
        """Before the host regions are written again: the last copy out of them may still be queued
        behind a step in flight (one enqueued before the host saw the previous step's tokens)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()


class InputBuilder:
    def __init__(
        self,
        *,
        block_size: int,
        device: torch.device,
        use_cascade: bool,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
    ) -> None:
        self.block_size = block_size
        self.use_cascade = use_cascade
        # NOTE: on the CPU a grouped request takes the cascade even alone in its step, so that
        # whether its prefix is attended apart (and merged) is the request's own property, not its
        # batch's: one request, the same bytes in any batch (reference_math's CPU attention).
        self.cascade_min_seqs = 1 if device.type == "cpu" else CASCADE_MIN_SEQS
        # Whether steps narrow the model's last layer to their sampled rows; off only to measure or test
        # the engine as it computed before (every row to the end).
        self.narrow_last_layer = True
        t, s, mb = max_tokens, max_seqs, max_blocks_per_seq
        self.arena = _Arena(
            {
                "input_ids": (t,),
                "positions": (t,),
                "slot_mapping": (t,),
                "logits_indices": (s,),
                "cu_seqlens_q": (s + 1,),
                "seq_lens": (s,),
                "kv_start": (s,),
                "group_cu_q": (s + 1,),
                "group_prefix_lens": (s,),
                "block_tables": (s, mb),
                "group_block_tables": (s, mb),
                # the sampled rows' decode-shaped metadata (block tables are gathered on the device)
                "sampled_seqs": (s,),
                "sampled_cu_q": (s + 1,),
                "sampled_seq_lens": (s,),
                "sampled_kv_start": (s,),
                "sampled_group_cu_q": (s + 1,),
            },
            device,
        )
        self._dev = {name: self.arena.device_view(name) for name in self.arena.shapes}
        self._host = {name: self.arena.host_view(name) for name in self.arena.shapes}

    def build(self, batch: list[ScheduledSeq]) -> StepInputs:
        return self.fill(*self.plan(batch))

    def fill(
        self,
        order: list[ScheduledSeq],
        groups: list[range],
        pad_seqs: int | None = None,
        pad_groups: int | None = None,
        max_group_q: int | None = None,
    ) -> StepInputs:
        """Writes a planned batch into the arena and uploads it. With pad_seqs (decode graphs) every row
        is one token, and the batch and its groups are padded with empty work to the captured sizes."""
        self.arena.wait_for_upload()
        n = len(order)
        rows = pad_seqs or n
        q_lens = np.ones(rows, dtype=np.int64)
        q_lens[:n] = [item.num_tokens for item in order]
        cu = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        h = self._host
        self._fill_sequences(order, groups, cu, rows)
        sampled = [i for i, item in enumerate(order) if item.sample]
        num_sampled = rows if pad_seqs else len(sampled)
        h["logits_indices"][: len(sampled)] = cu[1:][sampled] - 1
        h["logits_indices"][len(sampled) : num_sampled] = cu[len(sampled) + 1 : num_sampled + 1] - 1
        num_groups = pad_groups if pad_seqs and pad_groups is not None else len(groups)
        if num_groups:
            self._fill_groups(order, groups, cu, num_groups)
        narrow = self.narrow_last_layer and not pad_seqs and len(sampled) < int(cu[-1])
        shape = StepShape(
            int(cu[-1]),
            rows,
            num_sampled,
            len(groups),
            num_groups,
            max_query_len=_bucket(int(q_lens.max())),
            max_group_q=max_group_q
            or _bucket(max((int(cu[r.stop] - cu[r.start]) for r in groups), default=0)),
            cascade=bool(groups) or pad_groups is not None,
            sampled_group_q=self._fill_sampled(sampled, groups) if narrow else None,
        )
        self.arena.upload()
        return self.views(order, shape)

    def views(self, order: list[ScheduledSeq], shape: StepShape) -> StepInputs:
        """The step's tensors as views of the device arena, cut to `shape`."""
        inputs = self._views(order, shape)
        if shape.sampled_group_q is not None:
            inputs.sampled = self._sampled_views(inputs, shape.sampled_group_q)
        return inputs

    def plan(self, batch: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[range]]:
        """Cascade groups' rows first, each group contiguous and back to back (the prefix pass addresses a
        group's queries as one range), then every other row in scheduler order."""
        if not self.use_cascade:
            return batch, []
        members: dict[int, list[ScheduledSeq]] = {}
        for item in batch:
            if item.seq.shared_prefix_len >= CASCADE_MIN_PREFIX:
                members.setdefault(id(item.seq.group), []).append(item)
        chosen = [m for m in members.values() if len(m) >= self.cascade_min_seqs]
        in_groups = {id(item) for m in chosen for item in m}
        ordered = [item for m in chosen for item in m]
        ordered += [item for item in batch if id(item) not in in_groups]
        ranges, start = [], 0
        for m in chosen:
            ranges.append(range(start, start + len(m)))
            start += len(m)
        return ordered, ranges

    def _fill_sequences(
        self, order: list[ScheduledSeq], groups: list[range], cu: np.ndarray, rows: int
    ) -> None:
        h, bs = self._host, self.block_size
        n = len(order)
        cascade_rows = groups[-1].stop if groups else 0
        tables = h["block_tables"]
        tables[:rows] = 0  # padded rows read the reserved null block
        h["cu_seqlens_q"][: rows + 1] = cu
        h["seq_lens"][:rows] = 1
        h["kv_start"][:rows] = 0
        total = int(cu[-1])
        h["input_ids"][:total] = 0
        h["positions"][:total] = 0
        for i, item in enumerate(order):
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            h["input_ids"][cu[i] : cu[i + 1]] = seq.token_ids(start, end)
            h["positions"][cu[i] : cu[i + 1]] = np.arange(start, end)
            h["seq_lens"][i] = end
            tables[i, : len(seq.block_table)] = seq.block_table
            if i < cascade_rows:
                h["kv_start"][i] = seq.shared_prefix_len
        positions = h["positions"][:total].astype(np.int64)
        row_of_token = np.repeat(np.arange(rows), np.diff(cu))
        h["slot_mapping"][:total] = tables[row_of_token, positions // bs] * bs + positions % bs
        if n < rows:
            h["slot_mapping"][cu[n] : total] = 0  # padding writes into the null block

    def _fill_groups(
        self, order: list[ScheduledSeq], groups: list[range], cu: np.ndarray, num_groups: int
    ) -> None:
        h = self._host
        ends = [int(cu[r.stop]) for r in groups]
        h["group_cu_q"][0] = 0
        h["group_cu_q"][1 : len(ends) + 1] = ends
        # empty padded groups
        h["group_cu_q"][len(ends) + 1 : num_groups + 1] = ends[-1] if ends else 0
        h["group_prefix_lens"][:num_groups] = 0
        h["group_block_tables"][:num_groups] = 0
        for g, r in enumerate(groups):
            seq = order[r.start].seq
            h["group_prefix_lens"][g] = seq.shared_prefix_len
            h["group_block_tables"][g, : seq.num_shared_blocks] = seq.block_table[
                : seq.num_shared_blocks
            ]

    def _fill_sampled(self, sampled: list[int], groups: list[range]) -> int:
        """The sampled sequences as a decode step: one query each, their keys and groups as they are.
        Returns the most sampled rows of one group."""
        h = self._host
        rows = np.asarray(sampled, dtype=np.int64)
        m = len(rows)
        h["sampled_seqs"][:m] = rows
        h["sampled_cu_q"][: m + 1] = np.arange(m + 1)
        h["sampled_seq_lens"][:m] = h["seq_lens"][rows]
        h["sampled_kv_start"][:m] = h["kv_start"][rows]
        # Groups are contiguous row ranges from row 0, so their sampled rows are contiguous too.
        ends = np.searchsorted(rows, [r.stop for r in groups])
        h["sampled_group_cu_q"][0] = 0
        h["sampled_group_cu_q"][1 : len(groups) + 1] = ends
        return int(np.diff(ends, prepend=0).max(initial=0))

    def _sampled_views(self, inputs: StepInputs, max_group_q: int) -> SampledRows:
        """Views of what _fill_sampled wrote; the sampled rows are the step's logits rows."""
        d, step, m = self._dev, inputs.metadata, inputs.logits_indices.shape[0]
        cascade = None
        if step.cascade is not None:
            cascade = CascadeMetadata(
                group_cu_q=d["sampled_group_cu_q"][: inputs.shape.real_groups + 1],
                group_prefix_lens=step.cascade.group_prefix_lens,
                group_block_tables=step.cascade.group_block_tables,
                max_group_q=_bucket(max_group_q),  # as a decode step of these rows would take
            )
        meta = AttentionMetadata(
            slot_mapping=step.slot_mapping[:0],  # their keys and values are cached by then
            cu_seqlens_q=d["sampled_cu_q"][: m + 1],
            seq_lens=d["sampled_seq_lens"][:m],
            block_tables=step.block_tables.index_select(0, d["sampled_seqs"][:m]),
            max_query_len=1,
            kv_start=d["sampled_kv_start"][:m] if cascade is not None else None,
            cascade=cascade,
        )
        return SampledRows(token_rows=inputs.logits_indices, metadata=meta)

    def _views(self, order: list[ScheduledSeq], shape: StepShape) -> StepInputs:
        d, rows, num_groups, num_tokens = self._dev, shape.rows, shape.num_groups, shape.num_tokens
        cascade_meta = None
        if shape.cascade:
            cascade_meta = CascadeMetadata(
                group_cu_q=d["group_cu_q"][: num_groups + 1],
                group_prefix_lens=d["group_prefix_lens"][:num_groups],
                group_block_tables=d["group_block_tables"][:num_groups],
                max_group_q=shape.max_group_q,
            )
        meta = AttentionMetadata(
            slot_mapping=d["slot_mapping"][:num_tokens],
            cu_seqlens_q=d["cu_seqlens_q"][: rows + 1],
            seq_lens=d["seq_lens"][:rows],
            block_tables=d["block_tables"][:rows],
            max_query_len=shape.max_query_len,
            kv_start=d["kv_start"][:rows] if shape.cascade else None,
            cascade=cascade_meta,
        )
        return StepInputs(
            input_ids=d["input_ids"][:num_tokens],
            positions=d["positions"][:num_tokens],
            logits_indices=d["logits_indices"][: shape.num_sampled],
            metadata=meta,
            order=order,
            shape=shape,
        )
