"""The FP8 KV cache (kv_cache_dtype="fp8") in the engine: its configuration, its allocation (half the
bytes of a bf16 cache), what the model writes there, and runs that still give the tokens of the cache in
the model's dtype, grouped or not, decode windows of one step or eight, on both backends."""

from __future__ import annotations

import os

import pytest
import torch
from engine_checkpoints import (
    assert_no_leak,
    engine,
    greedy,
    random_prompts,
    run,
    shared_prefix_job,
    token_ids,
)

from prefixgrove import LLM
from prefixgrove.engine import EngineConfig
from prefixgrove.engine.attention.kv_cache import Fp8Cache
from prefixgrove_kernels.reference_math import quantize_kv

# The Triton backend on CPU tensors runs only in Triton's interpreter, which tests/conftest.py turns
# on where there is no GPU; on a GPU machine the kernels are checked on the device instead
# (tests/kernels/test_fp8_kv_cache.py, test_attention_gpu.py).
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs Triton on CPU tensors (interpreter)"
)


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_fp8_and_its_alias_are_taken_and_others_are_named(name: str) -> None:
    config = EngineConfig.create("tiny-random-llama", device="cpu", kv_cache_dtype=name)
    assert config.cache.kv_cache_dtype == name
    assert EngineConfig.create("tiny-random-llama", device="cpu").cache.kv_cache_dtype == "auto"
    for bad in ("fp8_e5m2", "int8", "bfloat16"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype='{bad}'"):
            EngineConfig.create("tiny-random-llama", device="cpu", kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2'"):  # vLLM's other FP8
        LLM("tiny-random-llama", device="cpu", kv_cache_dtype="fp8_e5m2")


def test_an_fp8_block_takes_half_the_bytes_of_a_bf16_one(llama_dir: str) -> None:
    def runner(kv_cache_dtype: str):  # type: ignore[no-untyped-def]
        llm = LLM(
            llama_dir, device="cpu", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
            num_gpu_blocks_override=8,
        )  # fmt: skip
        return llm.engine.runner

    auto, fp8 = runner("auto"), runner("fp8")
    assert fp8.bytes_per_block * 2 == auto.bytes_per_block
    k_cache, v_cache = fp8.kv_caches[0]
    for cache in (k_cache, v_cache):
        assert isinstance(cache, Fp8Cache)
        assert cache.codes.dtype == torch.float8_e4m3fn and cache.codes.shape[0] == 8
        assert cache.scale.dtype == torch.float32 and cache.scale.tolist() == [1.0]
    layer_bytes = sum(c.codes.numel() * c.codes.element_size() for c in (k_cache, v_cache))
    assert layer_bytes * len(fp8.kv_caches) == 8 * fp8.bytes_per_block
    assert isinstance(auto.kv_caches[0][0], torch.Tensor)
    assert auto.kv_caches[0][0].dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_the_first_layer_caches_the_quantized_keys_and_values(llama_dir: str, backend: str) -> None:
    """The first layer's keys and values of a prompt do not depend on the cache's dtype: the FP8
    cache holds exactly their codes (every slot: the unwritten ones stay zero)."""
    prompts = random_prompts([21, 9], seed=1)
    caches = {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = engine(llama_dir, attention_backend=backend, kv_cache_dtype=kv_cache_dtype)
        run(llm, prompts, greedy(1))
        caches[kv_cache_dtype] = llm.engine.runner.kv_caches[0]
    for plain, fp8 in zip(caches["auto"], caches["fp8"], strict=True):
        assert isinstance(fp8, Fp8Cache) and isinstance(plain, torch.Tensor)
        assert plain.abs().sum() > 0
        want = quantize_kv(plain, fp8.scale)
        assert torch.equal(fp8.codes.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("steps", [1, 8])
def test_fp8_grouped_equals_ungrouped_in_windows_of_one_and_eight(
    llama_dir: str, steps: int
) -> None:
    prompts = shared_prefix_job(num_prefixes=2, per_prefix=3, prefix_len=48, seed=2)
    params = greedy(10, ignore_eos=True)
    grouped_llm = engine(llama_dir, kv_cache_dtype="fp8", num_scheduler_steps=steps)
    grouped = run(grouped_llm, prompts, params)
    assert [o.num_cached_tokens for o in grouped] == [48] * 6
    apart = engine(
        llama_dir, kv_cache_dtype="fp8", enable_prefix_grouping=False, num_scheduler_steps=steps
    )
    assert token_ids(grouped) == token_ids(run(apart, prompts, params))
    assert_no_leak(grouped_llm)


@needs_interpreter
@pytest.mark.parametrize(
    ("decode_kernel", "prefill_kernel"), [("two-pass", "two-pass"), ("one-pass", "fused")]
)
def test_fp8_cascade_on_the_triton_backend_matches_the_torch_backend_ungrouped(
    llama_dir: str, decode_kernel: str, prefill_kernel: str
) -> None:
    """Small on purpose: the kernels run in Triton's interpreter here."""
    prompts = shared_prefix_job(num_prefixes=2, per_prefix=2, prefix_len=64, seed=3)
    params = greedy(3, ignore_eos=True)
    llm = engine(
        llama_dir, attention_backend="triton", kv_cache_dtype="fp8",
        cascade_decode_kernel=decode_kernel, cascade_prefill_kernel=prefill_kernel,
    )  # fmt: skip
    outs = run(llm, prompts, params)
    assert [o.num_cached_tokens for o in outs] == [64] * 4
    reference = engine(llama_dir, kv_cache_dtype="fp8", enable_prefix_grouping=False)
    assert token_ids(outs) == token_ids(run(reference, prompts, params))
    assert_no_leak(llm)


def test_fp8_cache_agrees_with_the_model_dtype_on_first_tokens(llama_dir: str) -> None:
    """As for FP8 weights (test_fp8.py): the tiny model's completions drift apart after the first
    differing token, so the first tokens are the fair comparison."""
    prompts = random_prompts([12, 30, 45, 7, 20, 33, 9, 50], seed=3)
    params = greedy(4, ignore_eos=True)
    plain = token_ids(run(engine(llama_dir), prompts, params))
    fp8 = token_ids(run(engine(llama_dir, kv_cache_dtype="fp8"), prompts, params))
    same = sum(p[0] == q[0] for p, q in zip(plain, fp8, strict=True))
    assert same >= 6, (plain, fp8)
