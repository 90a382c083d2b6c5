"""The structured-outputs mask kernel against its torch reference: masked rows get -inf exactly where
their bit is clear, other rows are untouched."""

from __future__ import annotations

import pytest
import torch

from prefixgrove_kernels.token_mask import apply_token_bitmask, apply_token_bitmask_ref


@pytest.mark.parametrize(
    ("n", "vocab", "rows"), [(5, 1000, [4, 0, 2]), (3, 64, [1]), (4, 4097, [0, 1, 2, 3])]
)
def test_kernel_matches_reference(device, n, vocab, rows):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(n, vocab, generator=gen)
    words = -(-vocab // 32)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int64
    )
    bitmask = bitmask.to(torch.int32)
    at = torch.tensor(rows, dtype=torch.int64)
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, at)
    got = logits.to(device)
    apply_token_bitmask(got, bitmask.to(device), at.to(device))
    assert torch.equal(got.cpu(), expected)
    # the reference itself: bit t of word t // 32 allows token t
    bits = [(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
    assert [bool(torch.isfinite(expected[rows[0], t])) for t in range(vocab)] == [
        b == 1 for b in bits
    ]
    untouched = [r for r in range(n) if r not in rows]
    assert torch.equal(expected[untouched], logits[untouched])


def test_a_bitmask_too_narrow_for_the_logits_is_refused(device):
    logits = torch.zeros(2, 100, device=device)
    with pytest.raises(ValueError, match="covers 96 token ids"):
        apply_token_bitmask(logits, torch.zeros(1, 3, dtype=torch.int32, device=device),
                            torch.zeros(1, dtype=torch.int64, device=device))  # fmt: skip
