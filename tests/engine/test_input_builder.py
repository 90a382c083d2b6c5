"""The input builder: a scheduled batch laid out as the step's flat device arrays."""

from __future__ import annotations

import numpy as np
import torch

from prefixgrove.engine.core.sequence import Group, ScheduledSeq, Sequence
from prefixgrove.engine.runner.input_builder import InputBuilder
from prefixgrove.engine.sampling.sampling_params import SamplingParams


def _builder(*, use_cascade: bool = True, max_seqs: int = 8) -> InputBuilder:
    return InputBuilder(
        block_size=16,
        device=torch.device("cpu"),
        use_cascade=use_cascade,
        max_tokens=64,
        max_seqs=max_seqs,
        max_blocks_per_seq=8,
    )


def test_every_arena_region_starts_16_byte_aligned():
    """Triton compiles one variant per pointer alignment: regions must not inherit odd offsets from
    the sizes before them (513-entry cu_seqlens regions, for one)."""
    builder = _builder(max_seqs=513)
    arena = builder.arena
    for name in arena.shapes:
        offset = arena.device_view(name).data_ptr() - arena.device.data_ptr()
        assert offset % 16 == 0, f"{name} starts {offset} bytes in"


def _member(seq_id: int, prompt_len: int, computed: int, table: list[int]) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", list(range(prompt_len)), SamplingParams(max_tokens=4), 0)
    seq.num_computed_tokens = computed
    seq.block_table = table
    return seq


def test_sampled_metadata_is_a_decode_step_of_the_sampled_rows():
    """Two grouped rows (one ends its prompt, one is mid-prompt) and one ungrouped decode row."""
    builder = _builder()
    prefix = _member(0, 64, 64, [1, 2, 3, 4])
    ends, middle = _member(1, 70, 64, [1, 2, 3, 4, 5]), _member(2, 80, 64, [1, 2, 3, 4, 6])
    group = Group("g", prefix_len=64, prefix_seq=prefix, members=[ends, middle])
    for seq in (ends, middle):
        seq.group, seq.num_shared_blocks = group, 4
    decoding = _member(3, 5, 5, [7])
    decoding.output_token_ids = [9]
    batch = [
        ScheduledSeq(decoding, 1, sample=True),
        ScheduledSeq(ends, 6, sample=True),
        ScheduledSeq(middle, 4, sample=False),
    ]
    inputs = builder.build(batch)
    assert [item.seq.seq_id for item in inputs.order] == [1, 2, 3]  # group rows first
    sampled = inputs.sampled
    assert sampled is not None and sampled.token_rows.shape[0] == 2
    # token rows: the group member's last prompt token (row 5 of 6 + 4 + 1), then the decode row
    assert sampled.token_rows.tolist() == [5, 10]
    meta = sampled.metadata
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2]
    assert meta.seq_lens.tolist() == [70, 6]
    assert meta.kv_start is not None and meta.kv_start.tolist() == [64, 0]
    assert meta.max_query_len == 1
    full_tables = inputs.metadata.block_tables
    assert np.array_equal(meta.block_tables.numpy(), full_tables[[0, 2]].numpy())
    assert meta.cascade is not None
    assert meta.cascade.group_cu_q.tolist() == [0, 1]  # one sampled row in the group
    assert meta.cascade.group_prefix_lens.tolist() == [64]


def test_decode_steps_are_not_narrowed():
    builder = _builder(use_cascade=False)
    seqs = [_member(i, 5, 5, [i + 1, i + 5]) for i in range(2)]
    for seq in seqs:
        seq.output_token_ids = [3]
    inputs = builder.build([ScheduledSeq(seq, 1, sample=True) for seq in seqs])
    assert inputs.sampled is None
