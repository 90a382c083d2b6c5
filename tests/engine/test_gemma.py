"""Gemma 2 and 3 through the engine's other paths: the Triton kernels' cascade (prefix pass, suffix
pass, fused suffix chunks and one-pass decode) over a shared prefix longer than the sliding window,
equal to transformers; FP8 weights on Gemma's layer; structured outputs.

The parity with transformers on the torch backend, grouping, the prefix cache and decode windows are
tests/engine/test_hf_parity.py's and test_families.py's (ARCHES holds gemma2 and gemma3)."""

from __future__ import annotations

import re

import pytest
from engine_checkpoints import (
    ARCHES,
    engine,
    greedy,
    random_prompts,
    run,
    save_model,
)
from test_hf_parity import assert_logprobs_match, hf_greedy

from prefixgrove import StructuredOutputsParams
from prefixgrove.engine.models.arch import ModelArch
from prefixgrove.engine.models.fp8_linear import Fp8Linear


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, str(path), save_model(request.param, path)


def test_triton_cascade_over_a_prefix_longer_than_the_window_matches_transformers(gemma) -> None:
    """An 80-token prefix (the window is 24; the cascade takes prefixes of 64 and more) shared by
    two prompts: grouped, so every pass of the cascade runs in Triton's interpreter, its forms for
    CUDA asked for by name."""
    arch, path, model = gemma
    prefix = random_prompts([80], seed=7)[0]
    prompts = [prefix + tail for tail in random_prompts([3, 6], seed=8)]
    llm = engine(
        path,
        attention_backend="triton",
        cascade_decode_kernel="one-pass",
        cascade_prefill_kernel="fused",
    )
    outputs = run(llm, prompts, greedy(4, logprobs=1))
    assert llm.engine.metrics.kv_blocks_shared > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 4), arch
        assert_logprobs_match(model, prompt, out.outputs[0])


def test_fp8_quantizes_every_projection_of_gemma_layers(gemma) -> None:
    """Every projection of each layer runs in FP8 behind Gemma's norms and activation; grouped and
    ungrouped runs still agree."""
    _, path, _ = gemma
    prefix = random_prompts([80], seed=5)[0]
    prompts = [prefix + tail for tail in random_prompts([5, 9], seed=6)]
    grouped = engine(path, quantization="fp8")
    for layer in grouped.engine.runner.model.layers:
        projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj)
        assert all(isinstance(p, Fp8Linear) for p in (*projections, layer.mlp.down_proj))
    params = greedy(6, ignore_eos=True)
    apart = engine(path, quantization="fp8", enable_prefix_grouping=False)
    first = [o.outputs[0].token_ids for o in run(grouped, prompts, params)]
    assert first == [o.outputs[0].token_ids for o in run(apart, prompts, params)]


def test_structured_outputs_hold_on_gemma(gemma) -> None:
    _, path, _ = gemma
    constraint = StructuredOutputsParams(regex="[a-d]{4}x")
    params = greedy(8, structured_outputs=constraint)
    out = run(engine(path), random_prompts([30], seed=9), params)[0]
    assert re.fullmatch("[a-d]{4}x", out.outputs[0].text), out.outputs[0].text


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu': only gelu_pytorch_tanh"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention: only causal"),
    ],
)
def test_a_gemma_config_the_layers_do_not_compute_is_refused_naming_it(
    change: dict, refusal: str
) -> None:
    config, _ = ARCHES["gemma2"]()
    config.architectures = ["Gemma2ForCausalLM"]
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=re.escape(refusal)):
        ModelArch.from_hf_config(config)
