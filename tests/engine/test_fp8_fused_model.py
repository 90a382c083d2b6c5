"""FP8 models whose RMSNorms and SiLU-and-mul write the next linear layer's input quantized
(`QuantizedRows`), instead of that layer quantizing it after them: the same logits as the unfused
path, bit for bit, on both backends; and a layer with a checkpoint's static input scale still
quantizes its own input."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checkpoints import engine, greedy, random_prompts, run, shared_prefix_job, token_ids
from test_fp8 import write_compressed_tensors

from prefixgrove import LLM
from prefixgrove.engine.models.fp8_linear import Fp8Linear, QuantizedRows, quantize_per_row
from prefixgrove.engine.models.linear import RowInvariantLinear


def decoder_layers(llm: LLM) -> list[Any]:
    return list(llm.engine.runner.model.layers)


def unfuse(llm: LLM) -> None:
    """Every FP8 layer quantizes its own input again, as before the fusion."""
    for layer in decoder_layers(llm):
        layer.input_layernorm.quantizes_output = False
        layer.post_attention_layernorm.quantizes_output = False
        layer.mlp.quantizes_activation = False


def record_logits(llm: LLM) -> list[torch.Tensor]:
    """Every step's logits, as the model hands them to the sampler."""
    model = llm.engine.runner.model
    compute: Callable[..., torch.Tensor] = model.compute_logits
    steps: list[torch.Tensor] = []

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        logits = compute(*args, **kwargs)
        steps.append(logits.clone())
        return logits

    model.compute_logits = recording
    return steps


def record_input_types(llm: LLM, layer: int) -> dict[str, set[type]]:
    """The types of what qkv_proj, gate_up_proj and down_proj of `layer` are called with."""
    seen: dict[str, set[type]] = {}
    decoder = decoder_layers(llm)[layer]
    named = {
        "qkv_proj": decoder.self_attn.qkv_proj,
        "gate_up_proj": decoder.mlp.gate_up_proj,
        "down_proj": decoder.mlp.down_proj,
    }
    for name, linear in named.items():
        types = seen.setdefault(name, set())
        linear.register_forward_pre_hook(lambda _m, args, types=types: types.add(type(args[0])))
    return seen


@pytest.fixture(scope="module")
def job() -> list[list[int]]:
    return shared_prefix_job(num_prefixes=1, per_prefix=3, prefix_len=40) + random_prompts(
        [5, 30], seed=3
    )


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_quantization_gives_the_unfused_logits(
    llama_dir: str, job: list[list[int]], backend: str
) -> None:
    """Chunked prefills (some steps sample nothing, so the last layer computes no rows past its
    keys and values), decode steps and grouped prefixes, once fused and once unfused."""
    kwargs = {"attention_backend": backend, "max_num_batched_tokens": 32, "max_num_seqs": 16}
    params = greedy(3, ignore_eos=True)
    fused = engine(llama_dir, quantization="fp8", **kwargs)
    fused_logits = record_logits(fused)
    fused_out = run(fused, job, params)
    unfused = engine(llama_dir, quantization="fp8", **kwargs)
    unfuse(unfused)
    unfused_logits = record_logits(unfused)
    unfused_out = run(unfused, job, params)
    assert len(fused_logits) == len(unfused_logits) > len(job)
    for got, want in zip(fused_logits, unfused_logits, strict=True):
        assert torch.equal(got, want)
    assert token_ids(fused_out) == token_ids(unfused_out)


def test_every_dynamic_fp8_layer_takes_its_input_quantized_by_the_op_before_it(
    llama_dir: str,
) -> None:
    llm = engine(llama_dir, quantization="fp8", max_num_batched_tokens=48, max_num_seqs=16)
    first, last = record_input_types(llm, 0), record_input_types(llm, -1)
    run(llm, random_prompts([30, 7], seed=1), greedy(3, ignore_eos=True))
    expected = {"qkv_proj": {QuantizedRows}, "gate_up_proj": {QuantizedRows}}
    assert first == last == {**expected, "down_proj": {QuantizedRows}}
    assert not llm.engine.runner.model.norm.quantizes_output  # lm_head stays in the model dtype


def test_an_unquantized_model_keeps_its_norms_and_activations_as_they_were(llama_dir: str) -> None:
    llm = engine(llama_dir)
    first = record_input_types(llm, 0)
    run(llm, random_prompts([9], seed=1), greedy(2, ignore_eos=True))
    assert first == {name: {torch.Tensor} for name in ("qkv_proj", "gate_up_proj", "down_proj")}


def test_layers_with_a_static_input_scale_quantize_their_own_inputs(
    llama_dir: str, tmp_path: Path
) -> None:
    stored = write_compressed_tensors(llama_dir, tmp_path / "fp8", static_input=0.05)
    llm = engine(stored)
    first = record_input_types(llm, 0)
    tokens = token_ids(run(llm, random_prompts([9], seed=1), greedy(2, ignore_eos=True)))
    assert len(tokens[0]) == 2
    assert first == {name: {torch.Tensor} for name in ("qkv_proj", "gate_up_proj", "down_proj")}


# ---- Fp8Linear ----------------------------------------------------------------------------------


@pytest.fixture()
def dense() -> RowInvariantLinear:
    torch.manual_seed(0)
    return RowInvariantLinear(96, 40, bias=True)


def test_fp8_linear_on_quantized_rows_equals_it_on_the_rows(dense: RowInvariantLinear) -> None:
    fp8 = Fp8Linear.from_linear(dense)
    x = torch.randn(37, 96) * torch.linspace(0.01, 30.0, 37).unsqueeze(1)
    assert torch.equal(fp8(QuantizedRows(*quantize_per_row(x))), fp8(x))


def test_fp8_linear_with_a_static_input_scale_refuses_quantized_rows(
    dense: RowInvariantLinear,
) -> None:
    fp8 = Fp8Linear.from_linear(dense, input_scale=torch.tensor(0.05))
    x = torch.randn(3, 96)
    with pytest.raises(ValueError, match=r"input_scale 0\.05.*pass it the unquantized rows"):
        fp8(QuantizedRows(*quantize_per_row(x)))
