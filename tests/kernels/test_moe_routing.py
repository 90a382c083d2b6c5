"""Top-k routing: the kernel picks the experts its reference picks (by logit, equal logits by the lower
id), with the weights of transformers' routers (Qwen3-MoE's, and Mixtral's always-renormalized fp32
ones) to a few ulps."""

from __future__ import annotations

import pytest
import torch
from transformers.models.mixtral.configuration_mixtral import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from prefixgrove_kernels.moe_routing import moe_routing, moe_routing_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# the weights' tolerance: a few fp32 ulps (exp and the row's sum in another order), or the rounding
# of those into a half-precision dtype
WEIGHT_RTOL = {torch.float32: 2**-21, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def logits_of(tokens: int, experts: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, experts, generator=gen) * 3).to(dtype)


def distinct_logits(tokens: int, experts: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Logits without ties in any row, also in half precision (where torch.topk's order among equal
    probabilities is unspecified): each row a permutation of evenly spaced values."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.linspace(-4.0, 4.0, experts)
    rows = [values[torch.randperm(experts, generator=gen)] for _ in range(tokens)]
    return torch.stack(rows).to(dtype)


def assert_same_routing(got: tuple, want: tuple, weight_dtype: torch.dtype) -> None:
    (weights, ids), (want_weights, want_ids) = got, want
    assert ids.dtype == torch.int32 and weights.dtype == weight_dtype
    assert torch.equal(ids.cpu(), want_ids.to(torch.int32))
    rtol = WEIGHT_RTOL[weight_dtype]
    torch.testing.assert_close(weights.cpu(), want_weights.to(weight_dtype), rtol=rtol, atol=0.0)


def assert_distinct_per_token(ids: torch.Tensor) -> None:
    ordered = ids.sort(dim=1).values
    assert (ordered[:, 1:] != ordered[:, :-1]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalize", [False, True], ids=["softmax", "renormalized"])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"),
    [(1, 4, 1), (130, 8, 2), (37, 60, 4), (300, 64, 8), (16, 128, 8)],
)
def test_kernel_routes_as_its_reference(device, dtype, renormalize, tokens, experts, top_k):
    logits = logits_of(tokens, experts, dtype, seed=tokens)
    got = moe_routing(logits.to(device), top_k, renormalize=renormalize, weight_dtype=dtype)
    want = moe_routing_ref(logits, top_k, renormalize=renormalize, weight_dtype=dtype)
    assert_same_routing(got, want, dtype)
    assert_distinct_per_token(got[1])


def identity_router(router: torch.nn.Module, experts: int) -> torch.nn.Module:
    """A router whose logits are its input (hidden size = experts, weight = identity)."""
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts))
    return router


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_routes_as_qwen3_moe_router(device, dtype, norm_topk_prob):
    experts, top_k = 48, 8
    config = Qwen3MoeConfig(
        hidden_size=experts, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
    )  # fmt: skip
    router = identity_router(Qwen3MoeTopKRouter(config), experts).to(dtype)
    logits = distinct_logits(29, experts, dtype, seed=3)
    with torch.no_grad():
        _, hf_weights, hf_ids = router(logits)
    got = moe_routing(logits.to(device), top_k, renormalize=norm_topk_prob, weight_dtype=dtype)
    assert_same_routing(got, (hf_weights, hf_ids), hf_weights.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_routes_as_mixtral_router_with_fp32_weights(device, dtype):
    experts, top_k = 8, 2
    config = MixtralConfig(
        hidden_size=experts, num_local_experts=experts, num_experts_per_tok=top_k
    )
    router = identity_router(MixtralTopKRouter(config), experts).to(dtype)
    logits = distinct_logits(45, experts, dtype, seed=4)
    with torch.no_grad():
        _, hf_weights, hf_ids = router(logits)
    assert hf_weights.dtype == torch.float32
    got = moe_routing(logits.to(device), top_k, renormalize=True, weight_dtype=torch.float32)
    assert_same_routing(got, (hf_weights, hf_ids), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_equal_logits_go_to_the_lower_id(device, dtype):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 3, (64, 16), generator=gen).to(dtype)  # many ties in each row
    weights, ids = moe_routing(logits.to(device), 6, renormalize=True, weight_dtype=torch.float32)
    assert_same_routing((weights, ids), moe_routing_ref(logits, 6, renormalize=True,
                        weight_dtype=torch.float32), torch.float32)  # fmt: skip
    assert_distinct_per_token(ids)
    picked = logits.float().gather(1, ids.cpu().long())
    # best logit first; among equal logits, ascending ids
    assert (picked[:, :-1] >= picked[:, 1:]).all()
    tie = picked[:, :-1] == picked[:, 1:]
    assert (ids[:, :-1].cpu()[tie] < ids[:, 1:].cpu()[tie]).all()
    # whichever tied experts torch.topk picks, their weights are these
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    hf = torch.topk(probs, 6, dim=-1).values
    hf = hf / hf.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(weights.cpu(), hf, rtol=WEIGHT_RTOL[torch.float32], atol=0.0)


def test_all_equal_logits_pick_the_first_experts(device):
    logits = torch.zeros(3, 10, device=device)
    weights, ids = moe_routing(logits, 4, renormalize=False, weight_dtype=torch.float32)
    assert torch.equal(ids.cpu(), torch.arange(4, dtype=torch.int32).expand(3, 4))
    torch.testing.assert_close(weights.cpu(), torch.full((3, 4), 0.1), rtol=2**-21, atol=0.0)


def test_top_k_of_every_expert_takes_each_once(device):
    logits = logits_of(9, 5, torch.float32, seed=6)
    weights, ids = moe_routing(logits.to(device), 5, renormalize=True, weight_dtype=torch.float32)
    assert torch.equal(
        ids.cpu().sort(dim=1).values, torch.arange(5, dtype=torch.int32).expand(9, 5)
    )
    torch.testing.assert_close(weights.sum(dim=1).cpu(), torch.ones(9), rtol=2**-20, atol=0.0)


def test_reads_strided_logits_and_no_tokens(device):
    wide = logits_of(11, 40, torch.float32, seed=7).to(device)
    logits = wide[:, :24]  # a view of a wider tensor: row stride 40
    got = moe_routing(logits, 3, renormalize=True, weight_dtype=torch.float32)
    want = moe_routing_ref(logits.cpu(), 3, renormalize=True, weight_dtype=torch.float32)
    assert_same_routing(got, want, torch.float32)
    weights, ids = moe_routing(wide[:0], 3, renormalize=True, weight_dtype=torch.float32)
    assert weights.shape == ids.shape == (0, 3)


def test_rejects_more_choices_than_experts(device):
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, 4\]"):
        moe_routing(
            torch.zeros(2, 4, device=device), 5, renormalize=True, weight_dtype=torch.float32
        )
