"""Top-k routing of a mixture-of-experts layer in one kernel: router logits [tokens, experts] ->
(weights [tokens, k], expert ids [tokens, k] int32), each token's k experts distinct, as transformers
routes (`*TopKRouter` in modeling_qwen3_moe.py, modeling_qwen2_moe.py, modeling_olmoe.py,
modeling_mixtral.py):

- Qwen3-MoE, Qwen2-MoE, OLMoE: softmax over all experts in fp32, the k largest probabilities, divided
  by their sum when the config's `norm_topk_prob` (`renormalize=True`), cast to the logits' dtype
  (`weight_dtype=router_logits.dtype`).
- Mixtral: the same, always renormalized (softmax over the top-k logits is the same math), with the
  weights left in fp32 (`weight_dtype=torch.float32`).

The experts are ranked by their logits in fp32, largest first, equal logits by the lower expert id,
so every target picks the same experts. Softmax keeps the logits' order, so torch.topk over the
probabilities picks these experts too, except (a) among equal logits, whose order torch leaves
unspecified (its CPU kernel picks neither the lowest nor the highest id), and (b) where two different
logits round to one probability, which then carry the same weight. The weights are the probabilities
torch computes, to a few fp32 ulps (exp and the row's sum are evaluated in another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgrove_kernels import checks
from prefixgrove_kernels.launch import KernelLaunch

LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE_ELEMENTS = 4096  # logits per program: BLOCK_T tokens of BLOCK_E experts
MAX_BLOCK_T = 64


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,  # [tokens, E] (row stride free)
    weights_ptr,  # [tokens, TOP_K] out
    ids_ptr,  # [tokens, TOP_K] int32 out
    tokens,
    E,
    logits_stride,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two >= TOP_K
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    row_ok = rows < tokens
    valid = row_ok[:, None] & (experts < E)[None, :]
    ptrs = logits_ptr + rows.to(tl.int64)[:, None] * logits_stride + experts[None, :]
    logits = tl.load(ptrs, mask=valid, other=-float("inf")).to(tl.float32)
    # softmax's numerators and denominator in fp32; a padding row's max (-inf) is replaced so that
    # it computes no nan
    row_max = tl.where(row_ok, tl.max(logits, axis=1), 0.0)
    exp = tl.where(valid, tl.exp(logits - row_max[:, None]), 0.0)
    total = tl.where(row_ok, tl.sum(exp, axis=1), 1.0)
    open_ = valid  # experts not picked yet
    picked_ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    picked_probs = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(open_, logits, -float("inf")), axis=1)
        # the lowest open id holding the best logit (open_ also keeps a row of -inf logits distinct)
        is_best = open_ & (logits == best[:, None])
        choice = tl.min(tl.where(is_best, experts[None, :], BLOCK_E), axis=1)
        chosen = experts[None, :] == choice[:, None]
        prob = tl.div_rn(tl.sum(tl.where(chosen, exp, 0.0), axis=1), total)
        open_ = open_ & ~chosen
        picked_ids = tl.where(slots[None, :] == j, choice[:, None], picked_ids)
        picked_probs = tl.where(slots[None, :] == j, prob[:, None], picked_probs)
    if RENORMALIZE:
        # the unused slots hold zeros; a padding row's sum is replaced, as its total was
        picked_sum = tl.where(row_ok, tl.sum(picked_probs, axis=1), 1.0)
        picked_probs = tl.div_rn(picked_probs, picked_sum[:, None])
    out_mask = row_ok[:, None] & (slots < TOP_K)[None, :]
    out_offsets = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    tl.store(ids_ptr + out_offsets, picked_ids, mask=out_mask)
    weights = picked_probs.to(weights_ptr.dtype.element_ty)
    tl.store(weights_ptr + out_offsets, weights, mask=out_mask)


def _check(router_logits: torch.Tensor, top_k: int, weight_dtype: torch.dtype) -> None:
    checks.check_tensor(
        "router_logits", router_logits, ndim=2, dtypes=LOGIT_DTYPES,
        device=router_logits.device, contiguous=False,
    )  # fmt: skip
    checks.check_unit_last_stride("router_logits", router_logits)
    num_experts = router_logits.shape[1]
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, {num_experts}] (the experts), got {top_k!r}")
    if weight_dtype not in WEIGHT_DTYPES:
        accepted = ", ".join(str(d) for d in WEIGHT_DTYPES)
        raise TypeError(f"weight_dtype {weight_dtype} is not accepted; use one of {accepted}")


def moe_routing_launch(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool, weight_dtype: torch.dtype
) -> tuple[KernelLaunch | None, torch.Tensor, torch.Tensor]:
    """Checks the arguments and plans the launch `moe_routing` makes; returns it with the outputs
    it fills (weights, ids)."""
    _check(router_logits, top_k, weight_dtype)
    tokens, num_experts = router_logits.shape
    weights = router_logits.new_empty((tokens, top_k), dtype=weight_dtype)
    ids = router_logits.new_empty((tokens, top_k), dtype=torch.int32)
    if tokens == 0:
        return None, weights, ids
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(MAX_BLOCK_T, TILE_ELEMENTS // block_e, triton.next_power_of_2(tokens)))
    options = {
        "TOP_K": top_k, "RENORMALIZE": bool(renormalize), "BLOCK_T": block_t,
        "BLOCK_E": block_e, "BLOCK_K": triton.next_power_of_2(top_k), "num_warps": 4,
    }  # fmt: skip
    args = (router_logits, weights, ids, tokens, num_experts, router_logits.stride(0))
    grid = (triton.cdiv(tokens, block_t),)
    return KernelLaunch(_topk_softmax_kernel, grid, args, options), weights, ids


def moe_routing(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool, weight_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [tokens, experts] -> (topk_weights [tokens, top_k] in weight_dtype, topk_ids
    [tokens, top_k] int32), best expert first; see the module docstring for each family's
    `renormalize` and `weight_dtype`."""
    launch, weights, ids = moe_routing_launch(
        router_logits, top_k, renormalize=renormalize, weight_dtype=weight_dtype
    )
    if launch is not None:
        launch.run()
    return weights, ids


def moe_routing_ref(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool, weight_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `moe_routing`: transformers' routers' math, with the experts picked by a
    stable sort of the logits (equal logits: the lower id first) instead of torch.topk."""
    _check(router_logits, top_k, weight_dtype)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    ranked = torch.sort(router_logits.float(), dim=-1, descending=True, stable=True).indices
    ids = ranked[:, :top_k]
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weight_dtype), ids.to(torch.int32)
