"""The CPU attention math: one query row's output and log-sum-exp are the same bytes whatever other rows
share its call and however many keys past its own the call holds, and the values are the plain masked
softmax's."""

from __future__ import annotations

import pytest
import torch

from prefixgrove_kernels.reference_math import KEY_TILE, QUERY_BLOCK, attend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 32
SCALE = HEAD_DIM**-0.5


@pytest.fixture(scope="module")
def qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    n = 3 * KEY_TILE + 7
    q = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    return q, k, v


def causal_chunk(qkv, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows at positions [first, last] attending causally to keys [0, last]."""
    q, k, v = qkv
    positions = torch.arange(first, last + 1)
    allowed = torch.arange(last + 1)[None, :] <= positions[:, None]
    return attend(q[first : last + 1], k[: last + 1], v[: last + 1], SCALE, allowed)


@pytest.mark.parametrize("position", [0, QUERY_BLOCK, KEY_TILE - 1, KEY_TILE, 2 * KEY_TILE + 5])
@pytest.mark.parametrize("before", [0, 1, QUERY_BLOCK + 1, 40])
@pytest.mark.parametrize("after", [0, 3, KEY_TILE + 2])
def test_a_row_is_the_same_bytes_in_any_chunk(qkv, position, before, after):
    alone_o, alone_lse = causal_chunk(qkv, position, position)
    first = max(0, position - before)
    last = min(qkv[0].shape[0] - 1, position + after)
    o, lse = causal_chunk(qkv, first, last)
    assert torch.equal(o[position - first], alone_o[0])
    assert torch.equal(lse[position - first], alone_lse[0])


def test_the_values_are_the_masked_softmax(qkv):
    q, k, v = qkv
    n = 2 * KEY_TILE + 9
    o, lse = causal_chunk(qkv, 0, n - 1)
    scores = torch.einsum("qhd,khd->hqk", q[:n], k[:n].repeat_interleave(2, dim=1)) * SCALE
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -torch.inf)
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[:n].repeat_interleave(2, dim=1))
    torch.testing.assert_close(o, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, scores.logsumexp(-1).T, rtol=1e-5, atol=1e-5)
