"""The fused mixture-of-experts MLP: the alignment is a stable sort of the pairs by expert padded to
the block size; the two grouped GEMMs give transformers' experts loop (which the reference is, bit
for bit) to the accumulation order, in x's dtype or with FP8 experts; the tile table picks by token
count per (device, E, N, K, dtype).

Triton's interpreter multiplies e4m3 tiles exactly, so the FP8 tests run the FP8 kernels themselves
on the CPU too (their speed and the GPU's e4m3 dot instructions are the GPU's to check)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeSparseMoeBlock

from prefixgrove_kernels.fused_moe import fused_moe, fused_moe_reference
from prefixgrove_kernels.moe_align import max_blocks, moe_align, moe_align_ref
from prefixgrove_kernels.moe_configs import (
    DEFAULT_TILES,
    MoeShape,
    MoeTileConfig,
    moe_shape,
    tile_config,
)
from prefixgrove_kernels.moe_routing import moe_routing
from prefixgrove_kernels.reference_math import quantize_rows_math

DTYPES = [torch.float32, torch.float16]
# |kernel - reference| / max |reference|: fp32 sums in another order; in fp16 also the roundings of
# the intermediate and of the output a sum order can move by an ulp or two
OUTPUT_TOL = {torch.float32: 2**-17, torch.float16: 2**-8}
SMALL_TILES = MoeTileConfig(block_m=16, block_n=32, block_k=32)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The references loop over experts in tiny torch ops, whose intra-op threads only contend for
    the machine's few shared cores (the 300-token case took 10x longer with two under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def routed(
    tokens: int, experts: int, top_k: int, seed: int, used: int | None = None
) -> torch.Tensor:
    """topk_ids [tokens, top_k] int32, distinct per token, drawn from the first `used` experts."""
    gen = torch.Generator().manual_seed(seed)
    pool = used or experts
    return torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(tokens)]).int()


def moe_inputs(tokens: int, experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    """x [tokens, hidden], w_gate_up [E, 2 * inter, hidden], w_down [E, hidden, inter]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w_down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    return x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype)


def assert_near(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    atol = rel * float(want.abs().max())
    torch.testing.assert_close(got.cpu(), want, rtol=0.0, atol=atol)


# ---- alignment ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "block_m", "used"),
    [(1, 4, 1, 16, None), (37, 60, 6, 16, 20), (300, 64, 8, 32, None), (50, 8, 2, 64, 3)],
)
def test_alignment_is_a_stable_sort_by_expert_padded_to_the_block(
    device, tokens, experts, top_k, block_m, used
):
    ids = routed(tokens, experts, top_k, seed=tokens, used=used)
    got = moe_align(ids.to(device), experts, block_m)
    want = moe_align_ref(ids, experts, block_m)
    assert torch.equal(got.num_padded.cpu(), want.num_padded)
    used_slots = int(want.num_padded)
    assert torch.equal(got.sorted_pair_ids[:used_slots].cpu(), want.sorted_pair_ids[:used_slots])
    assert torch.equal(got.block_experts.cpu(), want.block_experts)
    # every block holds one expert's pairs (padding: the sentinel tokens * top_k)
    blocks = want.sorted_pair_ids[:used_slots].view(-1, block_m).long()
    flat = torch.cat([ids.view(-1), torch.tensor([-1], dtype=torch.int32)])
    owners = flat[blocks]
    block_expert = want.block_experts[: blocks.shape[0], None]
    assert ((owners == block_expert) | (blocks == tokens * top_k)).all()


def test_alignment_bound_is_reached_when_every_pair_opens_a_run(device):
    ids = torch.arange(8, dtype=torch.int64).view(1, 8)  # one token, 8 experts of 64: 8 runs
    got = moe_align(ids.to(device), 64, 16)
    assert got.block_experts.numel() == max_blocks(8, 64, 16) == 8
    assert int(got.num_padded) == 8 * 16
    assert torch.equal(got.block_experts.cpu(), torch.arange(8, dtype=torch.int32))


# ---- the reference is transformers' experts loop ------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_transformers_experts_loop(dtype):
    tokens, experts, top_k, hidden, inter = 33, 8, 3, 40, 24
    config = Qwen3MoeConfig(
        hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
        num_experts_per_tok=top_k,
    )  # fmt: skip
    x, w_gate_up, w_down = moe_inputs(tokens, experts, hidden, inter, dtype, seed=1)
    hf = Qwen3MoeExperts(config).to(dtype)
    with torch.no_grad():
        hf.gate_up_proj.copy_(w_gate_up)
        hf.down_proj.copy_(w_down)
    ids = routed(tokens, experts, top_k, seed=1)
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        want = hf(x, ids.long(), weights)
    assert torch.equal(fused_moe_reference(x, w_gate_up, w_down, ids, weights), want)


# ---- the fused kernels --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter", "tiles"),
    [
        (1, 4, 1, 40, 24, None),
        (5, 4, 4, 72, 40, SMALL_TILES),
        (37, 16, 4, 72, 40, MoeTileConfig(block_m=16, block_n=64, block_k=32, group_m=4)),
        (64, 60, 6, 56, 20, MoeTileConfig(block_m=32, block_n=32, block_k=64)),
        (130, 32, 2, 40, 36, None),
        (300, 64, 8, 40, 24, MoeTileConfig(block_m=64, block_n=64, block_k=64, group_m=8)),
    ],
)
def test_fused_moe_is_its_reference(device, dtype, tokens, experts, top_k, hidden, inter, tiles):
    x, w_gate_up, w_down = moe_inputs(tokens, experts, hidden, inter, dtype, seed=tokens)
    ids = routed(tokens, experts, top_k, seed=tokens)
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(2))
    want = fused_moe_reference(x, w_gate_up, w_down, ids, weights)
    on = [t.to(device) for t in (x, w_gate_up, w_down, ids, weights)]
    assert_near(fused_moe(*on, tiles), want, OUTPUT_TOL[dtype])


def test_experts_without_tokens_and_weights_in_x_dtype(device):
    """Half the experts get no token (their runs are empty); the routing weights come in fp16."""
    tokens, experts, top_k = 23, 12, 3
    x, w_gate_up, w_down = moe_inputs(tokens, experts, 48, 20, torch.float16, seed=3)
    ids = routed(tokens, experts, top_k, seed=3, used=6) * 2  # even experts only
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(3)).half()
    want = fused_moe_reference(x, w_gate_up, w_down, ids, weights)
    on = [t.to(device) for t in (x, w_gate_up, w_down, ids, weights)]
    assert_near(fused_moe(*on, SMALL_TILES), want, OUTPUT_TOL[torch.float16])


def test_routing_then_fused_moe_is_qwen3_moe_sparse_block(device):
    """The two kernels as a model calls them give transformers' whole MoE block (fp32)."""
    tokens, experts, top_k, hidden, inter = 41, 16, 4, 40, 24
    config = Qwen3MoeConfig(
        hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
        num_experts_per_tok=top_k, norm_topk_prob=True,
    )  # fmt: skip
    block = Qwen3MoeSparseMoeBlock(config)
    x, w_gate_up, w_down = moe_inputs(tokens, experts, hidden, inter, torch.float32, seed=7)
    with torch.no_grad():
        block.gate.weight.copy_(
            torch.randn(experts, hidden, generator=torch.Generator().manual_seed(7))
        )
        block.experts.gate_up_proj.copy_(w_gate_up)
        block.experts.down_proj.copy_(w_down)
        want = block(x[None])[0]
    logits = (x @ block.gate.weight.detach().T).to(device)
    weights, ids = moe_routing(logits, top_k, renormalize=True, weight_dtype=torch.float32)
    on = [t.to(device) for t in (x, w_gate_up, w_down)]
    assert_near(fused_moe(*on, ids, weights), want, OUTPUT_TOL[torch.float32])


def quantized_experts(
    w: torch.Tensor, per_channel: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of w [E, rows, cols] with float32 scales [E, rows] (or [E], one per expert),
    after spreading the experts and channels over two decades so that a misplaced scale shows."""
    experts, rows, cols = w.shape
    shuffle = torch.randperm(experts * rows, generator=torch.Generator().manual_seed(seed))
    w = w.float() * torch.logspace(-1, 1, experts * rows)[shuffle].view(experts, rows, 1)
    if per_channel:
        codes, scale = quantize_rows_math(w.flatten(0, 1))
        return codes.view(experts, rows, cols), scale.view(experts, rows)
    codes, scale = quantize_rows_math(w.flatten(1, 2))
    return codes.view(experts, rows, cols), scale.view(experts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-expert"])
def test_fp8_experts_are_their_reference(device, dtype, per_channel):
    tokens, experts, top_k, hidden, inter = 29, 8, 2, 72, 40
    x, w_gate_up, w_down = moe_inputs(tokens, experts, hidden, inter, dtype, seed=4)
    gu, gu_scale = quantized_experts(w_gate_up, per_channel, seed=5)
    dn, dn_scale = quantized_experts(w_down, per_channel, seed=6)
    ids = routed(tokens, experts, top_k, seed=4)
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(4))
    scales = {"w_gate_up_scale": gu_scale, "w_down_scale": dn_scale}
    want = fused_moe_reference(x, gu, dn, ids, weights, **scales)
    on = [t.to(device) for t in (x, gu, dn, ids, weights)]
    got = fused_moe(*on, SMALL_TILES, **{name: s.to(device) for name, s in scales.items()})
    # an e4m3 code of the intermediate may round the other way when the sums' order moves it
    assert_near(got, want, 2**-6)
    # and the reference is the dequantized experts' MLP to the activations' quantization
    gu_scale, dn_scale = gu_scale.view(experts, -1, 1), dn_scale.view(experts, -1, 1)
    dequantized = ((gu.float() * gu_scale).to(dtype), (dn.float() * dn_scale).to(dtype))
    assert_near(want, fused_moe_reference(x, *dequantized, ids, weights), 2**-3)


# ---- arguments ----------------------------------------------------------------------------------


def test_no_tokens_and_mismatched_arguments(device):
    x, w_gate_up, w_down = (t.to(device) for t in moe_inputs(0, 4, 16, 8, torch.float32, seed=5))
    ids, weights = torch.empty(0, 2, dtype=torch.int32, device=device), x.new_empty(0, 2)
    assert fused_moe(x, w_gate_up, w_down, ids, weights).shape == (0, 16)
    with pytest.raises(ValueError, match=r"w_down must have shape \(4, 16, 8\)"):
        fused_moe(x, w_gate_up, w_down[:, :, :4], ids, weights)
    with pytest.raises(ValueError, match="FP8 experts"):
        fused_moe(x, w_gate_up, w_down, ids, weights, w_gate_up_scale=torch.ones(4))
    with pytest.raises(ValueError, match="topk_ids routes 3 tokens but x has 0"):
        fused_moe(x, w_gate_up, w_down, ids.new_zeros(3, 2), weights.new_zeros(3, 2))


# ---- tile table ---------------------------------------------------------------------------------

SHAPE = MoeShape("NVIDIA H200", 128, 768, 2048, "bfloat16")
SMALL, LARGE = MoeTileConfig(16, 64, 128), MoeTileConfig(64, 128, 64, group_m=8, num_warps=8)


def test_tile_table_takes_the_smallest_count_at_or_above_the_tokens():
    tuned = {SHAPE: {64: SMALL, 512: LARGE}}
    assert tile_config(SHAPE, 1, tuned) == tile_config(SHAPE, 64, tuned) == SMALL
    assert tile_config(SHAPE, 65, tuned) == tile_config(SHAPE, 512, tuned) == LARGE
    assert tile_config(SHAPE, 16384, tuned) == LARGE  # beyond the table: its largest count's


def test_a_shape_without_an_entry_takes_the_defaults():
    tuned = {SHAPE: {64: SMALL}}
    other_device = SHAPE._replace(device="NVIDIA A100-SXM4-80GB")
    for tokens in (1, 100, 100_000):
        assert tile_config(other_device, tokens, tuned) == tile_config(other_device, tokens, {})
    assert tile_config(other_device, 1, tuned) == DEFAULT_TILES[min(DEFAULT_TILES)]


def test_an_h100_sxm_takes_the_h200s_tiles_unless_it_has_its_own():
    h100 = SHAPE._replace(device="NVIDIA H100 80GB HBM3")
    assert tile_config(h100, 64, {SHAPE: {64: SMALL}}) == SMALL
    assert tile_config(h100, 64, {SHAPE: {64: SMALL}, h100: {64: LARGE}}) == LARGE
    h100_pcie = SHAPE._replace(device="NVIDIA H100 PCIe")  # 114 SMs: not the H200's
    assert tile_config(h100_pcie, 64, {SHAPE: {64: SMALL}}) == tile_config(h100_pcie, 64, {})


def test_the_key_names_device_experts_shape_and_dtype():
    x = torch.zeros(3, 40, dtype=torch.float16)
    w_gate_up = torch.zeros(6, 2 * 24, 40, dtype=torch.float16)
    assert moe_shape(x, w_gate_up) == MoeShape("cpu", 6, 24, 40, "float16")
    fp8 = moe_shape(x, w_gate_up.to(torch.float8_e4m3fn))
    assert fp8 == MoeShape("cpu", 6, 24, 40, "fp8_w8a8")


def test_tiles_are_checked():
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16, got 48"):
        MoeTileConfig(block_m=16, block_n=32, block_k=48)
    with pytest.raises(ValueError, match="num_warps must be one of"):
        MoeTileConfig(block_m=16, block_n=32, block_k=32, num_warps=3)
