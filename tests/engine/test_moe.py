"""Mixtures of experts beyond parity with transformers (test_hf_parity): FP8 experts, on the fused
kernels (the Triton ops, in the interpreter) and on their torch math, and a checkpoint saved in
transformers 5's stacked form loading as the published per-expert one does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_checkpoints import engine, greedy, random_prompts, run, save_checkpoint, token_ids

from prefixgrove.engine.models.fp8_linear import Fp8Linear
from prefixgrove.engine.models.moe import SparseMoe

PROMPTS = random_prompts([12, 30, 45, 7, 20, 33, 9, 50], seed=3)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_checkpoint("qwen3-moe", tmp_path_factory.mktemp("qwen3-moe"))


def _sparse(llm: object) -> SparseMoe:
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoe)]  # type: ignore[attr-defined]
    assert blocks
    return blocks[0]


def test_fp8_experts_take_the_kernels_and_agree_with_the_unquantized_model(qwen3_moe: str) -> None:
    params = greedy(4, ignore_eos=True)
    plain = token_ids(run(engine(qwen3_moe), PROMPTS, params))
    torch_ops = engine(qwen3_moe, quantization="fp8")
    block = _sparse(torch_ops)
    assert block.experts_gate_up.dtype == torch.float8_e4m3fn
    assert block.experts_down_scale is not None and block.experts_down_scale.shape == (8, 128)
    layer = torch_ops.engine.runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear)
    quant = token_ids(run(torch_ops, PROMPTS, params))
    # the tiny random model's logits sit close: its first tokens are the fair comparison
    assert sum(p[0] == q[0] for p, q in zip(plain, quant, strict=True)) >= 6, (plain, quant)
    # the fused kernels (interpreted) run the same W8A8 math as its torch version
    kernels = engine(qwen3_moe, quantization="fp8", attention_backend="triton")
    assert token_ids(run(kernels, PROMPTS, params)) == quant


def test_a_transformers_5_stacked_checkpoint_loads_as_the_published_one(
    qwen3_moe: str, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(Path(qwen3_moe) / "model.safetensors"))
    stacked: dict[str, torch.Tensor] = {}
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        if f"{prefix}.0.gate_proj.weight" not in tensors:
            continue  # the dense layer
        gate_up, down = [], []
        for e in range(8):
            gate_up.append(
                torch.cat(
                    [tensors.pop(f"{prefix}.{e}.{p}.weight") for p in ("gate_proj", "up_proj")]
                )
            )
            down.append(tensors.pop(f"{prefix}.{e}.down_proj.weight"))
        stacked[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        stacked[f"{prefix}.down_proj"] = torch.stack(down)
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        if (Path(qwen3_moe) / name).exists():
            (tmp_path / name).write_bytes((Path(qwen3_moe) / name).read_bytes())
    save_file({**tensors, **stacked}, str(tmp_path / "model.safetensors"))
    params = greedy(6, logprobs=1)
    assert token_ids(run(engine(str(tmp_path)), PROMPTS, params)) == token_ids(
        run(engine(qwen3_moe), PROMPTS, params)
    )


def test_a_compressed_tensors_checkpoint_keeps_its_experts_codes_and_scales(
    qwen3_moe: str, tmp_path: Path
) -> None:
    """Experts stored in e4m3 under one scale per projection run on those very codes and scales,
    each projection's scale over its rows (not quantized again per channel)."""
    from safetensors.torch import load_file
    from test_fp8 import write_compressed_tensors

    stored = write_compressed_tensors(qwen3_moe, tmp_path / "fp8", per_tensor=("experts",))
    block = _sparse(engine(stored))
    tensors = load_file(str(Path(stored) / "model.safetensors"))
    prefix = "model.layers.0.mlp.experts.5"
    down = tensors[f"{prefix}.down_proj.weight"]
    assert torch.equal(block.experts_down[5].view(torch.uint8), down.view(torch.uint8))
    assert block.experts_gate_up_scale is not None
    for half, proj in ((slice(0, 64), "gate_proj"), (slice(64, 128), "up_proj")):
        scale = tensors[f"{prefix}.{proj}.weight_scale"]
        assert torch.equal(block.experts_gate_up_scale[5, half], scale.expand(64))


@pytest.mark.parametrize(
    "preset, experts, width, hidden, top_k, renormalized",
    [
        ("qwen3-30b-a3b-random", 128, 768, 2048, 8, True),
        ("mixtral-8x7b-random", 8, 14336, 4096, 2, True),
        ("olmoe-1b-7b-random", 64, 1024, 2048, 8, False),
    ],
)
def test_the_mixture_of_experts_presets_carry_their_published_expert_shapes(
    preset: str, experts: int, width: int, hidden: int, top_k: int, renormalized: bool
) -> None:
    from prefixgrove.catalog.presets import load_hf_config
    from prefixgrove.engine.models.arch import ModelArch
    from prefixgrove.engine.models.registry import model_class

    config = load_hf_config(preset)
    arch = ModelArch.from_hf_config(config)
    assert arch.moe is not None and arch.hidden_size == hidden
    assert (arch.moe.num_experts, arch.moe.intermediate_size) == (experts, width)
    assert (arch.moe.top_k, arch.moe.norm_topk_prob) == (top_k, renormalized)
    model_class(config.architectures[0])  # a family the registry serves
