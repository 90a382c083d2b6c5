"""Every rope scaling transformers initialises gives the engine transformers' greedy tokens (fp32, CPU),
and the presets' tables stay bit-identical to the engine's float64 ones."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checkpoints import (
    build_model,
    engine,
    greedy,
    random_prompts,
    run,
    save_checkpoint,
    save_model,
)
from test_hf_parity import hf_greedy

from prefixgrove.catalog.presets import PRESETS
from prefixgrove.engine.models.arch import ModelArch
from prefixgrove.engine.models.rotary import (
    float64_frequencies,
    rope_parameters,
    rotary_table,
    transformers_frequencies,
)

HALF = 16  # head_dim 32 in engine_checkpoints
# Phi-3 style: original length at the top level of the config, factor implied by the lengths (4).
LONGROPE = {
    "max_position_embeddings": 256,
    "original_max_position_embeddings": 64,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.05 * i for i in range(HALF)],
        "long_factor": [1.0 + 0.5 * i for i in range(HALF)],
    },
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "default": ("llama3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "linear": (
        "mistral",
        {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
    ),
    "dynamic": (
        "qwen3",
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}},
    ),
    "yarn": (
        "qwen2",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 1024,
                "rope_theta": 1e6,
            }
        },
    ),
    "longrope": ("llama3", LONGROPE),
    "llama3": ("llama3", {}),
}
# sha256 of the [max_position_embeddings, head_dim] tables the presets had before transformers'
# rope initialisation was used: the canonical benchmark's numbers depend on them.
PRESET_TABLES = {
    "tiny-random-llama": "107363ed29eb3fdaaa7498dccef15242217418d273b259dc1a844baf8a8300cb",
    "llama-3.1-8b-random": "c5ffbfe66ff33aa4377de23b2de6c911b51859844d2f26acc4893df4ab4df714",
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch, overrides = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return request.param, str(path), save_model(arch, path, **overrides)


def assert_greedy_matches(llm: Any, model: Any, prompts: list[list[int]], max_tokens: int) -> None:
    outs = run(llm, prompts, greedy(max_tokens))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, max_tokens), len(prompt)


def test_greedy_tokens_match_transformers(checkpoint):
    """Prompts within longrope's original length (64) whose generations cross it: transformers then
    switches to the long factors token by token, as the engine's table does by position."""
    rope_type, path, model = checkpoint
    llm = engine(path, attention_backend="torch")
    assert llm.engine.config.model.arch.rope_type == rope_type
    assert_greedy_matches(llm, model, random_prompts((1, 16, 33, 58), seed=1), 12)


def test_greedy_tokens_match_transformers_on_triton_backend(tmp_path: Path):
    """yarn scales cos and sin by its attention factor; few tokens, the kernels are interpreted here."""
    arch, overrides = CASES["yarn"]
    model = save_model(arch, tmp_path, **overrides)
    llm = engine(str(tmp_path), attention_backend="triton")
    assert llm.engine.runner.backend.name == "triton"
    assert_greedy_matches(llm, model, random_prompts((5, 21), seed=2), 4)


def test_qwen25_style_rope_scaling_config_loads_as_yarn(tmp_path: Path):
    """Qwen2.5's config.json spells YaRN the pre-transformers-5 way: rope_scaling with "type"."""
    path = save_checkpoint("qwen2", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    config.update(rope_theta=1e6, rope_scaling=yarn)
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = engine(path, attention_backend="torch")
    assert llm.engine.config.model.arch.rope_type == "yarn"
    arch, overrides = CASES["yarn"]
    assert_greedy_matches(llm, build_model(arch, **overrides), random_prompts((9,), seed=3), 6)


@pytest.mark.parametrize("preset", list(PRESET_TABLES))
def test_preset_tables_are_bit_identical_to_before(preset: str):
    arch = ModelArch.from_hf_config(PRESETS[preset]())
    table = rotary_table(
        arch.head_dim,
        arch.max_position_embeddings,
        arch.rope_theta,
        arch.rope_scaling,
        max_position_embeddings=arch.max_position_embeddings,
    )
    assert hashlib.sha256(table.numpy().tobytes()).hexdigest() == PRESET_TABLES[preset]


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
def test_float64_frequencies_are_transformers_frequencies(rope_type: str):
    name, overrides = CASES[rope_type]
    arch = ModelArch.from_hf_config(build_model(name, **overrides).config)
    params = rope_parameters(arch.rope_theta, arch.rope_scaling)
    expected, scaling = transformers_frequencies(
        arch.head_dim, arch.max_position_embeddings, params
    )
    assert scaling == 1.0
    torch.testing.assert_close(float64_frequencies(arch.head_dim, params).float(), expected)


def test_longrope_uses_long_factors_from_the_original_length_on():
    params = rope_parameters(10000.0, LONGROPE["rope_parameters"])
    params["original_max_position_embeddings"] = 64
    short, scaling = transformers_frequencies(32, 256, params)
    long, _ = transformers_frequencies(32, 256, params, seq_len=65)
    table = rotary_table(32, 256, 10000.0, params, max_position_embeddings=256)
    for position, inv_freq in ((63, short), (64, long)):
        angles = position * inv_freq.double()
        expected = torch.cat([angles.cos(), angles.sin()]) * scaling
        torch.testing.assert_close(table[position], expected.float())


def test_unknown_rope_type_is_refused_with_the_supported_ones():
    with pytest.raises(ValueError, match="rope type 'wavy' is not supported; supported: default"):
        rotary_table(32, 8, 10000.0, {"rope_type": "wavy"})
