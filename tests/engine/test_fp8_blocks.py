"""FP8 with 128x128 block scales: checkpoints in DeepSeek-V3's and Qwen3's layout (`quant_method:
fp8`, `weight_block_size: [128, 128]`, `weight_scale_inv` beside each weight) load as stored, for
dense layers and experts and cut over tensor-parallel ranks on block edges, and compute what the
dequantized model computes with its activations quantized per token and 128 columns; the
`fp8_block_scales` option quantizes an unquantized checkpoint so at load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_checkpoints import engine, greedy, random_prompts, run, save_checkpoint, token_ids
from safetensors.torch import load_file, save_file

from prefixgrove.engine.config import EngineConfig
from prefixgrove.engine.models.base import CausalLM
from prefixgrove.engine.models.fp8_block_linear import Fp8BlockLinear
from prefixgrove.engine.models.loader import load_model
from prefixgrove.engine.models.moe import SparseMoe
from prefixgrove.engine.models.ops import create_ops
from prefixgrove.engine.models.sharding import Cut
from prefixgrove.engine.parallel.group import TensorParallel
from prefixgrove_kernels.fp8_block import dequantize_blocks, quantize_blocks_ref, row_scales

PROMPTS = random_prompts([12, 30, 45, 7, 20, 33, 9, 50], seed=3)
BLOCK_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}
# A Llama whose every tensor-parallel slice at 2 ranks is a whole number of 128-blocks
ALIGNED = {
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "intermediate_size": 512,
}


def write_block_fp8(source: str, dest: Path, dequantized: Path | None = None) -> str:
    """`source` with every decoder projection (experts' too) stored in e4m3 under 128x128 block
    scales, `weight_scale_inv`, as DeepSeek-V3 and Qwen3 publish them; with `dequantized`, the
    checkpoint those codes and scales stand for, unquantized, is written there too."""
    shutil.copytree(source, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    stored, plain = {}, {}
    for name, tensor in tensors.items():
        if "layers." in name and name.endswith("_proj.weight"):
            codes, scale = quantize_blocks_ref(tensor)
            stored[name] = codes
            stored[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
            plain[name] = dequantize_blocks(codes, scale)
        else:
            stored[name] = plain[name] = tensor
    save_file(stored, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "quantization_config": BLOCK_CONFIG}))
    if dequantized is not None:
        shutil.copytree(source, dequantized)
        save_file(plain, str(dequantized / "model.safetensors"), metadata={"format": "pt"})
    return str(dest)


@pytest.fixture(scope="module")
def llama_block(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(the block-FP8 checkpoint, its dequantized twin) of a tiny Llama whose k/v projections
    are 64 rows: half a block, stacked with q's whole block in the fused q/k/v."""
    root = tmp_path_factory.mktemp("llama-block")
    source = save_checkpoint("llama3", root / "source")
    return write_block_fp8(source, root / "fp8", root / "plain"), str(root / "plain")


@pytest.fixture(scope="module")
def moe_block(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The same for a tiny Qwen3-MoE: 8 experts of width 64 (down's input is half a block)."""
    root = tmp_path_factory.mktemp("moe-block")
    source = save_checkpoint("qwen3-moe", root / "source")
    return write_block_fp8(source, root / "fp8", root / "plain"), str(root / "plain")


def load_rank(model: str, parallel: TensorParallel) -> CausalLM:
    """One rank's shard of a checkpoint, loaded in this process (loading calls no collective)."""
    config = EngineConfig.create(model, device="cpu", dtype="float32").model
    ops = create_ops("torch")
    return load_model(model, config.arch, dtype=torch.float32, device="cpu", max_positions=64,
                      seed=0, ops=ops, quantization=config.quantization, parallel=parallel,
                      fp8_block_scales=config.fp8_block_scales)  # fmt: skip


def first_tokens_agree(a: list[list[int]], b: list[list[int]]) -> int:
    """The tiny random models' logits sit close, so once a token differs the completions drift
    apart: the first token, on the same prompt, is the fair comparison."""
    return sum(x[0] == y[0] for x, y in zip(a, b, strict=True))


def test_a_block_layer_is_the_group_quantized_input_times_the_dequantized_weight() -> None:
    """An independent plain-torch reference: each 128-column group of a row quantized to e4m3
    under its own amax / 448, times the weight's codes times its blocks' scales, in fp32."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(300, 200, bias=True)
    layer = Fp8BlockLinear.from_linear(dense)
    x = torch.randn(5, 300) * torch.logspace(-2, 2, 300)  # the groups' sizes differ
    groups = torch.nn.functional.pad(x, (0, 84)).view(5, 3, 128)
    scale = groups.abs().amax(dim=-1, keepdim=True) / 448.0
    x_q = ((groups / scale).to(torch.float8_e4m3fn).float() * scale).view(5, 384)[:, :300]
    w = layer.weight.float() * layer.weight_scale.repeat_interleave(128, dim=1)[:, :300]
    torch.testing.assert_close(layer(x), x_q @ w.T + dense.bias, rtol=1e-5, atol=1e-4)
    assert layer.weight_scale.shape == (200, 3)
    # rows 0-127 share their blocks' scales, rows 128-199 (a partial block) theirs
    assert torch.equal(layer.weight_scale[:128], layer.weight_scale[:1].expand(128, 3))
    assert not torch.equal(layer.weight_scale[128], layer.weight_scale[0])
    # and a row's result does not depend on its batch
    assert torch.equal(layer(x[2:3]), layer(x)[2:3])


def test_a_block_checkpoint_loads_its_codes_and_scales_as_stored(
    llama_block: tuple[str, str],
) -> None:
    stored, _ = llama_block
    llm = engine(stored)  # the checkpoint's config alone makes it run as block-scaled FP8
    assert llm.engine.config.model.quantization == "fp8"
    assert llm.engine.config.model.fp8_block_scales
    attn = llm.engine.runner.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, Fp8BlockLinear)
    tensors = load_file(str(Path(stored) / "model.safetensors"))
    prefix = "model.layers.0.self_attn"
    codes = torch.cat([tensors[f"{prefix}.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.weight.view(torch.uint8), codes.view(torch.uint8))
    # each part's blocks, one scale per row and column group: k's and v's 64 rows one block each
    scales = [tensors[f"{prefix}.{p}_proj.weight_scale_inv"] for p in "qkv"]
    assert [tuple(s.shape) for s in scales] == [(1, 1), (1, 1), (1, 1)]
    rows = torch.cat([row_scales(s, n) for s, n in zip(scales, (128, 64, 64), strict=True)])
    assert torch.equal(attn.qkv_proj.weight_scale, rows)


def test_a_block_checkpoint_computes_what_load_time_block_quantization_does(
    llama_block: tuple[str, str],
) -> None:
    """The dequantized weights quantized again in blocks at load give back the stored codes and
    scales: the same tokens and log-probs. Against the dequantized model unquantized, only the
    activations' quantization differs."""
    stored, plain = llama_block
    params = greedy(6, ignore_eos=True, logprobs=2)
    loaded = run(engine(stored), PROMPTS, params)
    requantized = engine(plain, quantization="fp8", fp8_block_scales=True)
    assert isinstance(requantized.engine.runner.model.layers[1].mlp.down_proj, Fp8BlockLinear)
    again = run(requantized, PROMPTS, params)
    assert token_ids(loaded) == token_ids(again)
    assert [o.outputs[0].logprobs for o in loaded] == [o.outputs[0].logprobs for o in again]
    unquantized = token_ids(run(engine(plain), PROMPTS, params))
    assert first_tokens_agree(token_ids(loaded), unquantized) >= 5


def test_block_scaled_experts_load_as_stored_and_run_on_the_kernels(
    moe_block: tuple[str, str],
) -> None:
    stored, plain = moe_block
    llm = engine(stored)
    experts = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoe))
    tensors = load_file(str(Path(stored) / "model.safetensors"))
    prefix = "model.layers.0.mlp.experts.3"
    down = tensors[f"{prefix}.down_proj.weight"]
    assert torch.equal(experts.experts_down[3].view(torch.uint8), down.view(torch.uint8))
    assert experts.experts_down_scale is not None and experts.experts_gate_up_scale is not None
    assert experts.experts_down_scale.shape == (8, 128, 1)  # [E, hidden, width groups]
    up_scale = row_scales(tensors[f"{prefix}.up_proj.weight_scale_inv"], 64)
    assert torch.equal(experts.experts_gate_up_scale[3, 64:], up_scale)
    params = greedy(4, ignore_eos=True)
    quant = token_ids(run(llm, PROMPTS, params))
    assert first_tokens_agree(quant, token_ids(run(engine(plain), PROMPTS, params))) >= 6
    # the fused kernels (interpreted) run the torch version's block-scaled math
    kernels = engine(stored, attention_backend="triton")
    assert token_ids(run(kernels, PROMPTS, params)) == quant


def test_fp8_block_scales_on_an_unquantized_checkpoint_blocks_each_fused_part(
    llama_dir: str,
) -> None:
    llm = engine(llama_dir, quantization="fp8", fp8_block_scales=True)
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8BlockLinear)
    # q (128 rows), k and v (64 each) blocked apart: k's scale is its own block's amax / 448
    k_rows = qkv.weight_scale[128:192]
    assert torch.equal(k_rows, k_rows[:1].expand(64, -1))
    assert not torch.equal(qkv.weight_scale[128], qkv.weight_scale[0])
    assert len(token_ids(run(llm, PROMPTS[:2], greedy(3, ignore_eos=True)))[0]) == 3


def test_fp8_block_scales_needs_fp8_and_an_unquantized_or_block_checkpoint(
    llama_dir: str, tmp_path: Path
) -> None:
    from test_fp8 import write_compressed_tensors

    with pytest.raises(ValueError, match="fp8_block_scales=True needs quantization='fp8'"):
        engine(llama_dir, fp8_block_scales=True)
    per_channel = write_compressed_tensors(llama_dir, tmp_path / "channel")
    with pytest.raises(ValueError, match="cannot be cut into blocks"):
        engine(per_channel, fp8_block_scales=True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\] is not supported"),
        ({"weight_block_size": None}, "without weight_block_size"),
        ({"activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
    ],
)
def test_other_fp8_layouts_are_refused_by_name(
    llama_block: tuple[str, str], tmp_path: Path, change: dict, message: str
) -> None:
    dest = tmp_path / "changed"
    shutil.copytree(llama_block[0], dest)
    config = json.loads((dest / "config.json").read_text())
    qc = {k: v for k, v in {**BLOCK_CONFIG, **change}.items() if v is not None}
    (dest / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with pytest.raises(ValueError, match=message):
        engine(str(dest))


def test_ranks_take_whole_blocks_of_weights_and_their_scales(tmp_path: Path) -> None:
    """q/k/v and gate/up cut by rows, o and down by columns, each scale tensor cut alike."""
    source = save_checkpoint("llama3", tmp_path / "source", **ALIGNED)
    stored = write_block_fp8(source, tmp_path / "fp8")
    whole = load_rank(stored, TensorParallel.single())
    for rank in (0, 1):
        shard = load_rank(stored, TensorParallel(rank, 2))
        for name, param in shard.named_parameters():
            if ".layers." not in f".{name}" or not name.endswith(("weight", "weight_scale")):
                continue
            full = dict(whole.named_parameters())[name]
            layout = shard.layout(name)
            if layout is None:
                expected = full
            elif layout.dim == 1:  # o, down: the rank's columns, and its column blocks' scales
                expected = Cut(1, 2, rank).take(full)
            else:
                expected = layout.local_of_full(full)
            assert torch.equal(param.float(), expected.float()), f"rank {rank}: {name}"


def test_a_cut_through_a_block_is_refused_by_name(llama_block: tuple[str, str]) -> None:
    """The tiny Llama's k has 64 rows: 2 ranks would hold 32 rows of one block each."""
    with pytest.raises(ValueError, match=r"k_proj\.weight_scale_inv: a cut of 64 into 2 slices"):
        load_rank(llama_block[0], TensorParallel(1, 2))


def test_ranks_take_whole_blocks_of_every_expert_and_their_scales(tmp_path: Path) -> None:
    """Each expert's gate/up rows and down columns, width 256 over 2 ranks: 128 each."""
    source = save_checkpoint("qwen3-moe", tmp_path / "source", moe_intermediate_size=256, **ALIGNED)
    stored = write_block_fp8(source, tmp_path / "fp8")
    whole = next(m for m in load_rank(stored, TensorParallel.single()).modules()
                 if isinstance(m, SparseMoe))  # fmt: skip
    for rank in (0, 1):
        model = load_rank(stored, TensorParallel(rank, 2))
        shard = next(m for m in model.modules() if isinstance(m, SparseMoe))
        gate_up = model.layout("layers.0.mlp.experts_gate_up")
        assert gate_up is not None
        for name in ("experts_gate_up", "experts_gate_up_scale"):
            want = gate_up.local_of_full(getattr(whole, name))
            assert torch.equal(getattr(shard, name).float(), want.float()), (rank, name)
        columns = Cut(2, 2, rank)
        for name in ("experts_down", "experts_down_scale"):  # the scales' columns are blocks
            want = columns.take(getattr(whole, name))
            assert torch.equal(getattr(shard, name).float(), want.float()), (rank, name)
