"""Block-scaled FP8 (128x128 weight blocks, 1x128 activation groups): the group quantization kernel
writes its torch reference's bytes, and the GEMM is its reference's fp32 sum of scaled group dots,
with partial last groups and blocks and either form of weight scales. Triton's interpreter
multiplies e4m3 tiles exactly, so these run the kernels themselves on the CPU."""

from __future__ import annotations

import pytest
import torch

from prefixgrove_kernels.fp8_block import (
    GROUP,
    NATIVE_ROWS,
    accumulation_bound,
    block_scaled_mm,
    block_scaled_mm_native,
    block_scaled_mm_ref,
    dequantize_blocks,
    native_block_scaled_mm_works,
    quantize_blocks_ref,
    quantize_groups,
    quantize_groups_ref,
    row_scales,
    whole_block_scales,
)
from prefixgrove_kernels.fused_moe import fused_moe, fused_moe_reference
from prefixgrove_kernels.moe_configs import MoeTileConfig

E4M3_STEP = 2.0**-3  # e4m3's largest relative spacing


def spread(rows: int, cols: int, seed: int, decades: float = 2.0) -> torch.Tensor:
    """Random values whose 128-column groups range over 10^(+-decades) in size."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    group_size = torch.logspace(-decades, decades, -(-cols // GROUP)).repeat_interleave(GROUP)[
        :cols
    ]
    return x * group_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("rows", "cols"), [(5, 96), (3, 300), (2, 1024), (37, 300)])
def test_group_quantization_writes_the_reference_bytes(device, dtype, rows, cols):
    x = spread(rows, cols, seed=cols).to(dtype)
    x[0, :GROUP] = 0.0  # an all-zero group keeps a finite scale
    q_ref, scale_ref = quantize_groups_ref(x)
    q, scale = quantize_groups(x.to(device))
    assert scale_ref.shape == (rows, -(-cols // GROUP))
    assert torch.equal(scale.cpu(), scale_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    # torch's blockwise GEMM's layout: rows padded to a multiple, scales group-major, same values
    q_p, scale_p = quantize_groups(x.to(device), NATIVE_ROWS, group_major=True)
    assert q_p.shape[0] % NATIVE_ROWS == 0 and scale_p.stride(0) == 1
    assert torch.equal(scale_p[:rows].cpu(), scale_ref)
    assert torch.equal(q_p[:rows].cpu().view(torch.uint8), q_ref.view(torch.uint8))
    # each group under its own scale: its largest value becomes 448
    assert float(scale_ref[0, 0]) == pytest.approx(1e-12)
    assert q_ref[1].float().abs().view(-1)[:GROUP].max() == 448.0


def test_block_quantization_gives_each_block_its_own_scale():
    w = spread(200, 300, seed=1).T.contiguous()  # [300, 200]: blocks differ along rows too
    codes, scale = quantize_blocks_ref(w)
    assert scale.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            block = codes[i * GROUP : (i + 1) * GROUP, j * GROUP : (j + 1) * GROUP].float()
            assert block.abs().max() == 448.0
    back = dequantize_blocks(codes, scale)
    assert torch.allclose(back, w, rtol=E4M3_STEP / 2, atol=float(scale.max()) * 2**-9)
    # the per-row form stands for the same values
    assert torch.equal(dequantize_blocks(codes, row_scales(scale, 300)), back)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (19, 200, 300), (33, 256, 256)])
@pytest.mark.parametrize("per_row", [False, True], ids=["block-scales", "row-scales"])
def test_gemm_is_its_reference(device, m, n, k, per_row):
    x, w = spread(m, k, seed=m), spread(n, k, seed=n) / 16
    a, a_scale = quantize_groups_ref(x)
    codes, w_scale = quantize_blocks_ref(w)
    if per_row:
        w_scale = row_scales(w_scale, n)
    want = block_scaled_mm_ref(a, a_scale, codes, w_scale, torch.float32)
    got = block_scaled_mm(*(t.to(device) for t in (a, a_scale, codes, w_scale)), torch.float32)
    if device.type == "cuda":  # the tensor cores accumulate FP8 products keeping ~14 bits
        assert ((got.cpu() - want).abs() <= accumulation_bound(a, a_scale, codes, w_scale)).all()
    else:  # the interpreter: fp32 sums in another order, a few ulps of the largest terms' sum
        atol = 1e-6 * float((x.abs() @ w.abs().T).max())
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=atol)
    # and the product is x @ w.T within FP8's error on both sides
    exact = x @ w.T
    assert (want - exact).abs().max() < 0.1 * exact.abs().max()


def test_block_scales_keep_small_groups_that_one_scale_per_tensor_flushes():
    # groups 10^8 apart, wider than e4m3's range under one scale; w's grow where x's shrink, so
    # that every group adds a share of the same size to the product
    x, w = spread(8, 512, seed=3, decades=4), spread(64, 512, seed=4, decades=4).flip(1)
    exact = x @ w.T
    blocked = block_scaled_mm_ref(*quantize_groups_ref(x), *quantize_blocks_ref(w), torch.float32)

    def per_tensor(t: torch.Tensor) -> torch.Tensor:
        scale = t.abs().max() / 448.0
        return (t / scale).to(torch.float8_e4m3fn).float() * scale

    flat = per_tensor(x) @ per_tensor(w).T
    assert (blocked - exact).norm() < 0.2 * (flat - exact).norm()


def test_mismatched_operands_are_named(device):
    a, a_scale = quantize_groups(torch.randn(4, 256, device=device))
    w, w_scale = quantize_blocks_ref(torch.randn(130, 256))
    w, w_scale = w.to(device), w_scale.to(device)
    with pytest.raises(ValueError, match=r"w_scale must be \[130, 2\].*or \[2, 2\]"):
        block_scaled_mm(a, a_scale, w, w_scale[:1], torch.float32)
    with pytest.raises(ValueError, match="a has 256 columns but w has 128"):
        block_scaled_mm(a, a_scale, w[:, :128], w_scale[:, :1], torch.float32)
    with pytest.raises(TypeError, match=r"a has dtype torch\.float32"):
        block_scaled_mm(a.float(), a_scale, w, w_scale, torch.float32)
    assert block_scaled_mm(a[:0], a_scale[:0], w, w_scale, torch.float32).shape == (0, 130)


@pytest.mark.gpu
def test_gemm_in_bfloat16_on_the_gpu():
    x = spread(77, 640, seed=5).to(torch.bfloat16)
    w = spread(384, 640, seed=6) / 16
    a, a_scale = quantize_groups(x.cuda())
    codes, w_scale = quantize_blocks_ref(w)
    got = block_scaled_mm(a, a_scale, codes.cuda(), w_scale.cuda(), torch.bfloat16)
    want = block_scaled_mm_ref(a.cpu(), a_scale.cpu(), codes, w_scale, torch.float32)
    # the tensor cores' FP8 accumulation errs by the products' magnitudes, not the result's
    bound = accumulation_bound(a.cpu(), a_scale.cpu(), codes, w_scale)
    assert ((got.float().cpu() - want).abs() <= bound).all()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 300, 4096])
def test_torchs_blockwise_gemm_is_the_triton_gemms_on_the_gpu(rows):
    """The engine takes torch's blockwise-scaled GEMM where it runs (Hopper, CUDA 12.9+)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("blockwise-scaled FP8 GEMMs need Hopper or later")
    dev = torch.device("cuda")
    x = spread(rows, 1024, seed=rows).to(torch.bfloat16).to(dev)
    a, a_scale = quantize_groups(x, NATIVE_ROWS, group_major=True)
    codes, blocks = quantize_blocks_ref(spread(768, 1024, seed=9) / 16)
    codes, blocks = codes.to(dev), blocks.to(dev)
    got = block_scaled_mm_native(a, a_scale, codes, blocks, torch.bfloat16)[:rows]
    a, a_scale = a[:rows], a_scale[:rows].contiguous()  # the padding rows are not written
    want = block_scaled_mm_ref(a, a_scale, codes, blocks, torch.float32)
    assert ((got.float() - want).abs() <= accumulation_bound(a, a_scale, codes, blocks)).all()
    assert native_block_scaled_mm_works(dev), "this GPU and torch offer blockwise scaling"
    empty = block_scaled_mm_native(a[:0], a_scale[:0], codes, blocks, torch.bfloat16)
    assert empty.shape == (0, 768)  # a step with no rows for this layer


def test_per_row_scales_fold_back_into_blocks_only_where_blocks_are_whole():
    _, blocks = quantize_blocks_ref(spread(256, 256, seed=3))
    assert torch.equal(whole_block_scales(row_scales(blocks, 256)), blocks)
    # a fused q|k whose 64-row k starts mid-block: its rows' scales change inside a block
    _, q = quantize_blocks_ref(spread(128, 256, seed=4))
    _, k = quantize_blocks_ref(spread(64, 256, seed=5))
    fused = torch.cat([row_scales(q, 128), row_scales(k, 64), row_scales(k, 64) * 2])
    assert whole_block_scales(fused) is None
    assert whole_block_scales(row_scales(blocks, 256)[:200]) is None  # not a multiple of 128
    assert not native_block_scaled_mm_works(torch.device("cpu"))


# ---- block-scaled experts (fused_moe) ----------------------------------------------------------


def blocked_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert of w [E, rows, cols] in 128x128 blocks: codes, scales [E, rows, groups]."""
    parts = [quantize_blocks_ref(expert) for expert in w]
    codes = torch.stack([c for c, _ in parts])
    return codes, torch.stack([row_scales(s, w.shape[1]) for _, s in parts])


@pytest.mark.parametrize(
    "tiles", [MoeTileConfig(block_m=16, block_n=32, block_k=32), None], ids=["k32", "default"]
)
def test_block_scaled_experts_are_their_reference(device, tiles):
    """hidden 200 and width 136: both GEMMs end on a partial group and a partial block."""
    tokens, experts, top_k, hidden, width = 9, 4, 2, 200, 136
    gen = torch.Generator().manual_seed(7)
    x = spread(tokens, hidden, seed=7)
    gate_up, gate_up_scale = blocked_experts(spread(experts * 2 * width, hidden, seed=8).view(
        experts, 2 * width, hidden) / 64)  # fmt: skip
    down, down_scale = blocked_experts(torch.randn(experts, hidden, width, generator=gen) / 16)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    scales = {"w_gate_up_scale": gate_up_scale, "w_down_scale": down_scale}
    want = fused_moe_reference(x, gate_up, down, ids, weights, **scales)
    on = [t.to(device) for t in (x, gate_up, down, ids.int(), weights)]
    got = fused_moe(*on, tiles, **{name: s.to(device) for name, s in scales.items()})
    # an e4m3 code of the intermediate may round the other way when the sums' order moves it
    torch.testing.assert_close(got.cpu(), want, rtol=0.0, atol=2**-6 * float(want.abs().max()))
    # and it is the MLP of the dequantized experts, to the activations' quantization
    dequantized = [
        torch.stack([dequantize_blocks(c, s) for c, s in zip(codes, scale, strict=True)])
        for codes, scale in ((gate_up, gate_up_scale), (down, down_scale))
    ]
    plain = fused_moe_reference(x, *dequantized, ids, weights)
    torch.testing.assert_close(want, plain, rtol=0.0, atol=2**-3 * float(plain.abs().max()))


def test_block_and_channel_scales_do_not_mix():
    w = torch.randn(2, 256, 128)
    codes, scale = blocked_experts(w)
    x, ids, weights = torch.randn(3, 128), torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1)
    with pytest.raises(ValueError, match="both be block scales"):
        fused_moe_reference(x, codes, codes[:, :128].transpose(1, 2).contiguous(), ids, weights,
                            w_gate_up_scale=scale, w_down_scale=torch.ones(2, 128))  # fmt: skip
