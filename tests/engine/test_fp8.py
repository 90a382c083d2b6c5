"""FP8 W8A8 linear layers (quantization="fp8") on the CPU: the emulation equals a plain-torch
quantize-dequantize-matmul, keeps a row's result independent of its batch, and an engine running it
still agrees with the unquantized model on most greedy tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_checkpoints import SMOLLM2, engine, greedy, random_prompts, run, smollm2_file, token_ids
from safetensors.torch import load_file, save_file

from prefixgrove.catalog.presets import load_tokenizer
from prefixgrove.engine.models.fp8_linear import Fp8Linear, quantize_per_row
from prefixgrove.engine.models.linear import RowInvariantLinear


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Quantize both sides per row to e4m3 (amax / 448), dequantize, multiply in fp32."""

    def qdq(t: torch.Tensor) -> torch.Tensor:
        scale = (t.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
        return (t / scale).to(torch.float8_e4m3fn).float() * scale

    return qdq(x) @ qdq(weight).t()


@pytest.fixture()
def layer() -> tuple[RowInvariantLinear, Fp8Linear]:
    torch.manual_seed(0)
    dense = RowInvariantLinear(96, 40, bias=False)
    return dense, Fp8Linear.from_linear(dense)


def test_matches_quantize_dequantize_reference(layer: tuple[RowInvariantLinear, Fp8Linear]) -> None:
    dense, fp8 = layer
    x = torch.randn(37, 96) * torch.linspace(0.01, 30.0, 37).unsqueeze(1)
    got = fp8(x)
    want = reference(x, dense.weight.detach())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and the quantization is real: the result is not the dense product
    assert not torch.equal(got, dense(x))


def test_per_tensor_scale_is_expanded_per_channel() -> None:
    weight = (torch.randn(8, 16) * 10).to(torch.float8_e4m3fn)
    fp8 = Fp8Linear(weight, torch.tensor(0.5), None, torch.float32)
    assert fp8.weight_scale.shape == (8,)
    x = torch.randn(3, 16)
    q, s = quantize_per_row(x)
    torch.testing.assert_close(fp8(x), (q.float() * s) @ (weight.float() * 0.5).t())


def test_a_row_is_the_same_alone_and_in_batches(
    layer: tuple[RowInvariantLinear, Fp8Linear],
) -> None:
    _, fp8 = layer
    x = torch.randn(53, 96) * 4
    full = fp8(x)
    for rows in (1, 3, 16, 17, 40):
        assert torch.equal(fp8(x[:rows]), full[:rows]), rows
    assert torch.equal(fp8(x[20:21]), full[20:21])


def test_unsupported_method_is_named(llama_dir: str) -> None:
    with pytest.raises(ValueError, match="awq"):
        engine(llama_dir, quantization="awq")


def test_engine_fp8_agrees_with_unquantized_on_first_tokens(llama_dir: str) -> None:
    """The tiny random model's logits are close together, so once a token differs the rest of the
    completion drifts apart; the first token, taken on the same prompt, is the fair comparison."""
    prompts = random_prompts([12, 30, 45, 7, 20, 33, 9, 50], seed=3)
    params = greedy(4, ignore_eos=True)
    plain = token_ids(run(engine(llama_dir), prompts, params))
    fp8_llm = engine(llama_dir, quantization="fp8")
    layer = fp8_llm.engine.runner.model.layers[0]
    assert isinstance(layer.mlp.down_proj, Fp8Linear)
    quant = token_ids(run(fp8_llm, prompts, params))
    same = sum(p[0] == q[0] for p, q in zip(plain, quant, strict=True))
    assert same >= 6, (plain, quant)


@pytest.fixture(scope="module")
def smollm2_completions() -> tuple[list[list[int]], list[list[int]]]:
    """Four prompts and the trained model's greedy completions of them in its own dtype."""
    smollm2_file()
    tok = load_tokenizer(SMOLLM2)
    texts = [
        "The capital of France is",
        "Water boils at a temperature of",
        "def fibonacci(n):",
        "The three primary colors are",
    ]
    prompts = [tok.encode(t) for t in texts]
    llm = engine(SMOLLM2, attention_backend="torch")
    return prompts, token_ids(run(llm, prompts, greedy(16, ignore_eos=True)))


@pytest.mark.parametrize(
    ("options", "floor"),
    [({"quantization": "fp8"}, 0.8), ({"kv_cache_dtype": "fp8"}, 0.9)],
    ids=["fp8-weights", "fp8-kv-cache"],
)
def test_smollm2_in_fp8_agrees_with_the_model_dtype_on_most_forced_tokens(
    smollm2_completions: tuple[list[list[int]], list[list[int]]],
    options: dict[str, str],
    floor: float,
) -> None:
    prompts, plain = smollm2_completions
    fp8 = engine(SMOLLM2, attention_backend="torch", **options)
    # Teacher-forced: the FP8 model reads each prompt followed by the plain model's greedy
    # completion; at each completion position its own top-1 (rank 1) should mostly be that token.
    # (Free-running completions part at the first differing digit and never meet again.)
    forced = [prompt + completion for prompt, completion in zip(prompts, plain, strict=True)]
    outs = run(fp8, forced, greedy(1, prompt_logprobs=0))
    agree = total = 0
    for prompt, out in zip(prompts, outs, strict=True):
        entries = out.prompt_logprobs
        assert entries is not None
        for pos in range(len(prompt), len(out.prompt_token_ids)):
            agree += entries[pos][out.prompt_token_ids[pos]].rank == 1
            total += 1
    assert total == 64
    assert agree >= floor * total, agree


def test_fp8_grouped_equals_ungrouped(llama_dir: str) -> None:
    prefix = random_prompts([80], seed=5)[0]
    prompts = [prefix + tail for tail in random_prompts([5, 9, 14], seed=6)]
    params = greedy(8, ignore_eos=True)
    grouped = token_ids(run(engine(llama_dir, quantization="fp8"), prompts, params))
    apart = token_ids(
        run(engine(llama_dir, quantization="fp8", enable_prefix_grouping=False), prompts, params)
    )
    assert grouped == apart


def write_compressed_tensors(
    source: str, dest: Path, per_tensor: tuple[str, ...] = (), static_input: float | None = None
) -> str:
    """The tiny checkpoint in compressed-tensors' FP8 layout: each decoder projection stored in e4m3
    with its `weight_scale` (per output channel, or one per tensor for names in `per_tensor`) and,
    with `static_input`, an `input_scale`; config.json names the method."""
    shutil.copytree(source, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    out = {}
    for name, tensor in tensors.items():
        if "layers." in name and name.endswith("_proj.weight"):
            if any(part in name for part in per_tensor):
                scale = (tensor.abs().amax() / 448.0).reshape(1)
                q = (tensor / scale).to(torch.float8_e4m3fn)
            else:
                q, scale = quantize_per_row(tensor)
            base = name.removesuffix(".weight")
            out[name], out[base + ".weight_scale"] = q, scale.float()
            if static_input is not None:
                out[base + ".input_scale"] = torch.tensor([static_input])
        else:
            out[name] = tensor
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    strategy = "tensor" if per_tensor else "channel"
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token"},
            }
        },
        "ignore": ["lm_head"],
    }
    (dest / "config.json").write_text(json.dumps(config))
    return str(dest)


def test_compressed_tensors_checkpoint_gives_the_tokens_of_load_time_fp8(
    llama_dir: str, tmp_path: Path
) -> None:
    stored = write_compressed_tensors(llama_dir, tmp_path / "fp8")
    prompts = random_prompts([12, 30, 45, 7], seed=4)
    params = greedy(10, ignore_eos=True, logprobs=3)
    from_checkpoint = engine(stored)  # the checkpoint's config alone makes it run as FP8
    assert from_checkpoint.engine.config.model.quantization == "fp8"
    loaded = run(from_checkpoint, prompts, params)
    quantized = run(engine(llama_dir, quantization="fp8"), prompts, params)
    assert token_ids(loaded) == token_ids(quantized)
    assert [o.outputs[0].logprobs for o in loaded] == [o.outputs[0].logprobs for o in quantized]


def test_per_tensor_scales_and_static_input_scales_load_as_stored(
    llama_dir: str, tmp_path: Path
) -> None:
    stored = write_compressed_tensors(
        llama_dir, tmp_path / "fp8", per_tensor=("k_proj", "o_proj"), static_input=0.05
    )
    llm = engine(stored)
    attn = llm.engine.runner.model.layers[0].self_attn
    tensors = load_file(str(Path(stored) / "model.safetensors"))
    prefix = "model.layers.0.self_attn"
    o_scale = tensors[f"{prefix}.o_proj.weight_scale"]
    assert torch.equal(attn.o_proj.weight, tensors[f"{prefix}.o_proj.weight"])
    assert torch.equal(attn.o_proj.weight_scale, o_scale.expand(attn.o_proj.out_features))
    qkv = torch.cat([tensors[f"{prefix}.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.weight.view(torch.uint8), qkv.view(torch.uint8))
    assert attn.qkv_proj.input_scale == pytest.approx(0.05)
    assert len(token_ids(run(llm, random_prompts([9], seed=1), greedy(4, ignore_eos=True)))[0]) == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quant_method": "awq"}, "'awq' is not supported"),
        ({"strategy": "block"}, "strategy 'block' is not supported"),
    ],
)
def test_unsupported_checkpoint_quantization_is_named(
    llama_dir: str, tmp_path: Path, change: dict, message: str
) -> None:
    stored = Path(write_compressed_tensors(llama_dir, tmp_path / "fp8"))
    config = json.loads((stored / "config.json").read_text())
    qc = config["quantization_config"]
    if "quant_method" in change:
        qc["quant_method"] = change["quant_method"]
    else:
        qc["config_groups"]["group_0"]["weights"]["strategy"] = change["strategy"]
    (stored / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        engine(str(stored))
