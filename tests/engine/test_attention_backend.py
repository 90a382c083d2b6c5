"""How the attention backend launches the cascade prefix pass on steps with prefill rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prefixgrove.engine.attention.backend import WIDEST_TILE_HINT, create_backend
from prefixgrove.engine.attention.metadata import AttentionMetadata, CascadeMetadata

BLOCK, HEADS, KV_HEADS, DIM = 16, 4, 2, 32
# Triton's interpreter runs the kernels on CPU tensors; on a GPU machine they need CUDA ones.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def mixed_step(chunk_in_group: bool) -> tuple[torch.Tensor, AttentionMetadata]:
    """A group of two sequences over a one-block prefix (both decoding, or the second with a
    3-token chunk of its own prompt: a suffix chunk) beside an ungrouped 4-token prefill."""
    q_lens = [1, 3 if chunk_in_group else 1, 4]
    int32 = {"dtype": torch.int32, "device": DEVICE}
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], **int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64, device=DEVICE),
        cu_seqlens_q=cu,
        seq_lens=torch.tensor([BLOCK + 5, BLOCK + 7, 4], **int32),
        # block 0 is the prefix; each sequence's own keys are in a block of its own
        block_tables=torch.tensor([[0, 1], [0, 2], [3, 0]], **int32),
        max_query_len=max(q_lens),
        kv_start=torch.tensor([BLOCK, BLOCK, 0], **int32),
        cascade=CascadeMetadata(
            group_cu_q=torch.tensor([0, q_lens[0] + q_lens[1]], **int32),
            group_prefix_lens=torch.tensor([BLOCK], **int32),
            group_block_tables=torch.tensor([[0]], **int32),
            max_group_q=q_lens[0] + q_lens[1],
        ),
    )
    q = torch.randn(sum(q_lens), HEADS, DIM, generator=torch.Generator().manual_seed(1))
    return q.to(DEVICE), meta


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("chunk_in_group", [True, False], ids=["suffix-chunk", "decode-rows-only"])
def test_fused_form_runs_every_prefill_step_in_one_prefix_pass_variant(
    backend: str, chunk_in_group: bool
) -> None:
    """Fused, unsplit, widest tile, whether or not the groups hold a suffix chunk (each form, split
    count and tile shape is a kernel variant that a fresh machine would compile mid-run); and the
    result equals the two-pass form's."""
    q, meta = mixed_step(chunk_in_group)
    cache = torch.randn(2, 4, BLOCK, KV_HEADS, DIM, generator=torch.Generator().manual_seed(2))
    cache = cache.to(DEVICE)
    k_cache, v_cache = cache[0], cache[1]
    fused = create_backend(backend, fuse_suffix_chunks=True)
    launches: list[dict] = []

    def recording(*args, **kwargs):
        launches.append(kwargs)
        return fused.prefix(*args, **kwargs)

    out = dataclasses.replace(fused, prefix=recording).forward(q, k_cache, v_cache, meta, 0.2)
    [launch] = launches
    assert launch["suffix_chunks"] is not None
    assert launch["num_splits"] == 1 and launch["tile_rows"] >= WIDEST_TILE_HINT
    two_pass = create_backend(backend).forward(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(out, two_pass, atol=1e-5, rtol=1e-5)
