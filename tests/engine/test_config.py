"""Engine settings are checked when the engine is built, with messages that name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_checkpoints import engine, save_checkpoint

from prefixgrove.engine import EngineConfig
from prefixgrove.jobs.tokenize import PromptTokenizer


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 12}, r"block_size=12: must be a power of two"),
        ({"block_size": 4}, r"block_size=4"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization=1.5"),
        ({"num_gpu_blocks_override": 1}, r"num_blocks=1"),
        ({"max_num_seqs": 0}, r"max_num_seqs=0"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, r"max_num_batched_tokens=32"),
        ({"num_scheduler_steps": 0}, r"num_scheduler_steps=0"),
        ({"attention_backend": "flash"}, r"attention_backend='flash'"),
        ({"cascade_decode_kernel": "fused"}, r"cascade_decode_kernel='fused'"),
        ({"cascade_prefill_kernel": "one-pass"}, r"cascade_prefill_kernel='one-pass'"),
        ({"device": "tpu"}, r"device='tpu'"),
        ({"dtype": "float8"}, r"dtype='float8'"),
        ({"max_model_len": 1}, r"max_model_len=1"),
        ({"max_model_len": 10**6}, r"max_model_len=1000000 exceeds"),
    ],
)
def test_invalid_engine_setting_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.create("tiny-random-llama", **{"device": "cpu", **kwargs})


def test_unknown_engine_argument_is_a_type_error():
    with pytest.raises(TypeError, match="max_num_sequences"):
        EngineConfig.create("tiny-random-llama", max_num_sequences=4)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        EngineConfig.create("tiny-random-llama", device="cpu", attention_backend="triton")


def test_cpu_defaults_are_fp32_torch_backend_and_eager():
    config = EngineConfig.create("tiny-random-llama", device="cpu")
    assert str(config.model.dtype) == "torch.float32"
    assert config.attention_backend == "torch" and config.enforce_eager
    assert config.scheduler.num_scheduler_steps == 1


@pytest.mark.parametrize(
    ("device", "backend", "kernels"),
    [
        ("cuda", "auto", ("one-pass", "fused")),
        ("cuda", "torch", ("two-pass", "two-pass")),
        ("cpu", "auto", ("two-pass", "two-pass")),
    ],
)
def test_cascade_takes_one_pass_and_fused_chunks_only_with_triton_on_cuda(device, backend, kernels):
    """One pass (decode) and fused suffix chunks (prefill) are faster on the GPU; elsewhere two
    passes keep every row's arithmetic the same however it was batched, so results do not depend on
    batching."""
    config = EngineConfig.create("tiny-random-llama", device=device, attention_backend=backend)
    assert (config.cascade_decode_kernel, config.cascade_prefill_kernel) == kernels
    chosen = EngineConfig.create(
        "tiny-random-llama", device=device, attention_backend=backend,
        cascade_decode_kernel="one-pass", cascade_prefill_kernel="fused",
    )  # fmt: skip
    assert (chosen.cascade_decode_kernel, chosen.cascade_prefill_kernel) == ("one-pass", "fused")


def test_mistral_sliding_window_caps_max_model_len(tmp_path: Path):
    path = save_checkpoint("mistral", tmp_path, sliding_window=256)
    assert EngineConfig.create(path, device="cpu").model.max_model_len == 256
    with pytest.raises(ValueError, match=r"max_model_len=512 exceeds .*\(256\)"):
        EngineConfig.create(path, device="cpu", max_model_len=512)


def test_the_planner_checks_requests_against_the_engine_context_limit(tmp_path: Path):
    """One rule for both: the model's positions, capped at its sliding window."""
    path = save_checkpoint("mistral", tmp_path, sliding_window=256)
    engine_limit = EngineConfig.create(path, device="cpu").model.max_model_len
    assert PromptTokenizer(path).max_model_len == engine_limit == 256
    assert PromptTokenizer(path, max_model_len=128).max_model_len == 128


def test_head_dim_the_kernels_cannot_run_is_refused_when_the_engine_is_built(tmp_path: Path):
    """Not in the middle of the first step, which also leaves that step's requests in the engine."""
    path = save_checkpoint("qwen3", tmp_path, head_dim=16)
    with pytest.raises(ValueError, match=r"head_dim=16"):
        engine(path, attention_backend="triton")
