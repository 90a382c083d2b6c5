"""GGUF files of every family whose GGUF files transformers reads (Llama, Qwen2, Qwen3, Phi-3,
Qwen2-MoE, Qwen3-MoE, Gemma 2, Gemma 3): the engine computes what transformers computes from the
same file, each tensor-parallel rank reads its cut of every tensor and nothing more, and the
families transformers does not read from GGUF (OLMoE, llama.cpp's Mixtral) are refused by name.
Gemma's facts that transformers leaves at its defaults are read as llama.cpp reads them.

The files are tiny random models written in llama.cpp's layout (gguf_checkpoints.py), in fp32 on the
CPU; the tensor-parallel ones in Q8_0, so that column cuts read quantized blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_checkpoints import ARCHES, build_model, engine, greedy, random_prompts, run
from gguf_checkpoints import write_gguf, write_metadata
from sharded_loads import assert_shard_is_cut_of_whole, load_on_cpu
from transformers import AutoModelForCausalLM, PreTrainedModel

from prefixgrove.catalog import gguf
from prefixgrove.engine.config import EngineConfig
from prefixgrove.engine.parallel.group import TensorParallel

# 4 experts, 2 per token; every layer sparse, as llama.cpp's Qwen MoEs are
_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2}
# Gemma 3's layers as llama.cpp and transformers lay them out from a file: five local, one global
_GEMMA3_LAYERS = {
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
}
# transformers' Gemma defaults, which it keeps where it reads the file alone
_GEMMA_DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256}

# test family -> (llama.cpp architecture, config overrides). transformers maps no expert width and
# no Qwen3 head size from the metadata: where it reads the file alone, those are its config
# class's defaults.
DEFAULT_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-untied": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 128}),
    "phi3": ("phi3", {}),
    "qwen2-moe": (
        "qwen2moe",
        {**_EXPERTS, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632},
    ),
    "qwen3-moe": ("qwen3moe", {**_EXPERTS, "moe_intermediate_size": 768, "mlp_only_layers": []}),
    "gemma2": (
        "gemma2",
        {**_GEMMA_DEFAULTS, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    ),
    "gemma3": ("gemma3", {**_GEMMA_DEFAULTS, **_GEMMA3_LAYERS}),
}
# Other shapes, which only the file states (Gemma: its attention scale is its head size's, as
# llama.cpp takes it, and Gemma 3's global layers scale their rotary positions linearly)
FILE_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {}),
    "qwen2-moe": ("qwen2moe", _EXPERTS),
    "qwen3-moe": ("qwen3moe", {**_EXPERTS, "mlp_only_layers": []}),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 32}),
    "gemma3": (
        "gemma3",
        {
            **_GEMMA3_LAYERS,
            "query_pre_attn_scalar": 32,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
    ),
}
STEPS = 6


def _write(
    family: str, shapes: tuple[str, dict[str, Any]], directory: Path, quantized: bool = False
) -> tuple[PreTrainedModel, str]:
    gguf_arch, overrides = shapes
    model = build_model(family, **overrides)
    return model, write_gguf(model, directory / f"{family}.gguf", gguf_arch, quantized)


def _transformers_greedy(
    model: PreTrainedModel, prompts: Sequence[list[int]]
) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Each prompt's greedy tokens and each step's log-probabilities, one full forward a step."""
    runs = []
    for prompt in prompts:
        ids, steps = list(prompt), []
        for _ in range(STEPS):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1]
            steps.append(torch.log_softmax(logits.float(), dim=-1))
            ids.append(int(steps[-1].argmax()))
        runs.append((ids[len(prompt) :], steps))
    return runs


def _assert_engine_matches(path: str, reference: PreTrainedModel) -> None:
    prompts = random_prompts([9, 23])
    expected = _transformers_greedy(reference, prompts)
    llm = engine(path)
    outputs = run(llm, prompts, greedy(STEPS, logprobs=2, ignore_eos=True))
    llm.engine.close()
    for out, (tokens, steps) in zip(outputs, expected, strict=True):
        assert out.outputs[0].token_ids == tokens
        for logprobs, step in zip(out.outputs[0].logprobs, steps, strict=True):
            for token, logprob in logprobs.items():
                assert logprob.logprob == pytest.approx(step[token].item(), abs=1e-4)


@pytest.mark.parametrize("family", DEFAULT_SHAPES)
def test_the_engine_computes_what_transformers_reads_from_the_file(
    family: str, tmp_path: Path
) -> None:
    _, path = _write(family, DEFAULT_SHAPES[family], tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=Path(path).name, dtype=torch.float32
    ).eval()
    _assert_engine_matches(path, reference)


@pytest.mark.parametrize("family", FILE_SHAPES)
def test_shapes_only_the_file_states_are_read_from_it(family: str, tmp_path: Path) -> None:
    """Expert widths and Qwen3's head size other than transformers' defaults: transformers, told
    the shapes, reads the file's tensors; the engine reads the shapes from the file too."""
    source, path = _write(family, FILE_SHAPES[family], tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=Path(path).name, config=source.config, dtype=torch.float32
    ).eval()
    _assert_engine_matches(path, reference)


def _dequantized_values(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the values every dequantization of a GGUF tensor yields, from now on."""
    import gguf.quants

    counted: list[int] = []
    dequantize = gguf.quants.dequantize

    def counting(data: np.ndarray, qtype: Any) -> np.ndarray:
        out = dequantize(data, qtype)
        counted.append(out.size)
        return out

    monkeypatch.setattr(gguf.quants, "dequantize", counting)
    return counted


@pytest.mark.parametrize(
    ("family", "quantized"),
    [("phi3", False), ("qwen2-moe", True), ("qwen3-moe", True), ("gemma3", True)],
)
def test_a_rank_dequantizes_only_its_cut_of_each_tensor(
    family: str, quantized: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Phi-3's fused q/k/v and gate/up cut part by part, and o_proj's and down_proj's columns,
    in F32 (whose units are values, not bytes); every expert's rows of gate and up and its
    block-aligned columns of down, in Q8_0; Gemma 3's layers, whose norms (whole) are stored
    as 1 + w. A rank's shard is the cut of the whole model, of which it dequantized little more
    than half (the router and norms are whole)."""
    shapes = FILE_SHAPES.get(family) or DEFAULT_SHAPES[family]
    _, path = _write(family, shapes, tmp_path, quantized)
    counted = _dequantized_values(monkeypatch)
    whole = dict(load_on_cpu(path, TensorParallel.single()).named_parameters())
    whole_values = sum(counted)
    for rank in (0, 1):
        counted.clear()
        shard = load_on_cpu(path, TensorParallel(rank, 2))
        assert sum(counted) < 0.55 * whole_values
        assert_shard_is_cut_of_whole(shard, whole, f"rank {rank}")


@pytest.mark.parametrize(
    ("family", "gguf_arch", "named"),
    [("olmoe", "olmoe", "'olmoe'"), ("mixtral", "llama", "Mixtral")],
)
def test_a_family_transformers_does_not_read_from_gguf_is_refused_by_name(
    family: str, gguf_arch: str, named: str, tmp_path: Path
) -> None:
    _, path = _write(family, (gguf_arch, {}), tmp_path)
    with pytest.raises(ValueError, match=named) as refused:
        EngineConfig.create(path, device="cpu", dtype="float32")
    assert "qwen3moe (Qwen3MoeForCausalLM)" in str(refused.value)
    assert "safetensors directory" in str(refused.value)


def test_rotary_scaling_stored_as_tensors_is_refused_by_name(tmp_path: Path) -> None:
    """Phi-3 128k's LongRoPE factors: transformers' Phi-3 config from GGUF has no rope scaling."""
    factors = {f"rope_factors_{kind}.weight": np.ones(16, np.float32) for kind in ("long", "short")}
    path = write_gguf(build_model("phi3"), tmp_path / "phi3.gguf", "phi3", extra=factors)
    with pytest.raises(ValueError, match=r"rope_factors_long\.weight, rope_factors_short\.weight"):
        EngineConfig.create(path, device="cpu", dtype="float32")


@pytest.mark.parametrize(("arch", "blocks"), [("gemma2", 46), ("gemma3", 62)])
def test_gemma_27b_files_scale_attention_by_hidden_size_over_heads(
    arch: str, blocks: int, tmp_path: Path
) -> None:
    """As llama.cpp: the 27B models (told by their block count, as no metadata states the scale)
    scale by hidden size / heads, the others by their head size; transformers keeps 256 for all."""
    config, _ = ARCHES[arch]()
    config.num_hidden_layers, config.head_dim = blocks, 16
    path = write_metadata(config, tmp_path / f"{arch}-27b.gguf", arch, {})
    assert gguf.load_config(path).query_pre_attn_scalar == 128 // 4
    config.num_hidden_layers = blocks - 1
    path = write_metadata(config, tmp_path / f"{arch}.gguf", arch, {})
    assert gguf.load_config(path).query_pre_attn_scalar == 16


def test_gemma3_rotary_scaling_other_than_linear_is_refused_by_name(tmp_path: Path) -> None:
    config, _ = ARCHES["gemma3"]()
    fields = {"gemma3.rope.scaling.type": "yarn", "gemma3.rope.scaling.factor": 8.0}
    path = write_metadata(config, tmp_path / "gemma3.gguf", "gemma3", fields)
    with pytest.raises(ValueError, match=r"Gemma 3 rotary scaling 'yarn' with factor 8\.0"):
        EngineConfig.create(path, device="cpu", dtype="float32")
