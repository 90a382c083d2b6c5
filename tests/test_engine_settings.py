"""One set of engine settings: `LLM(...)`, `prefixgrove run` and `prefixgrove serve worker` build the
same engine from the same knobs, whether they come as keyword arguments, flags or PREFIXGROVE_*
variables, and with none given they take the same defaults for the device."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from prefixgrove import LLM
from prefixgrove.cli import main
from prefixgrove.engine import EngineConfig
from prefixgrove.engine.core import llm_engine
from prefixgrove.engine_settings import EngineSettings, engine_settings

MODEL = "tiny-random-llama"
KNOBS = {
    "device": "cpu",
    "dtype": "float32",
    "kv_cache_dtype": "fp8",
    "max_model_len": 256,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 96,
    "enable_prefix_caching": False,
    "num_scheduler_steps": 4,
    "seed": 3,
}


class _Built(Exception):
    """Raised where a worker would start leasing: its engine is built, nothing else is needed."""


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[EngineConfig]:
    """The config of every engine built while the test runs, in order."""
    configs: list[EngineConfig] = []
    init = llm_engine.LLMEngine.__init__

    def record(self: Any, config: EngineConfig) -> None:
        configs.append(config)
        init(self, config)

    def worker(settings: Any, engine: Any, *rest: Any) -> Any:  # the engine is built by now
        raise _Built

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", record)
    monkeypatch.setattr("prefixgrove.worker.runner.Worker", worker)
    return configs


def flags(knobs: dict[str, Any]) -> list[str]:
    return [w for k, v in knobs.items() for w in ("--" + k.replace("_", "-"), str(v).lower())]


def run_job(tmp_path: Path, *words: str) -> None:
    job = tmp_path / "in.jsonl"
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}
    job.write_text(json.dumps(line) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run", str(job), "-o", str(out), "--model", MODEL, "--quiet", *words]) == 0
    assert out.read_text().count("\n") == 1


def serve_worker(*words: str) -> None:
    with pytest.raises(_Built):
        main(["serve", "worker", "--model", MODEL, "--quiet", *words])


def test_the_three_entry_points_build_one_config_from_one_set_of_knobs(
    built: list[EngineConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    LLM(MODEL, **KNOBS)
    run_job(tmp_path, *flags(KNOBS))
    serve_worker(*flags(KNOBS))
    for name, value in KNOBS.items():  # the same knobs as variables
        monkeypatch.setenv("PREFIXGROVE_" + name.upper(), str(value))
    serve_worker()
    assert len(built) == 4
    assert built[0] == built[1] == built[2] == built[3]
    scheduler = built[0].scheduler
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (8, 96)
    assert (scheduler.num_scheduler_steps, built[0].model.seed) == (4, 3)
    assert not built[0].enable_prefix_caching and built[0].cache.kv_cache_dtype == "fp8"


def test_with_no_knobs_every_entry_point_takes_the_devices_defaults(
    built: list[EngineConfig], tmp_path: Path
) -> None:
    LLM(MODEL, device="cpu")
    run_job(tmp_path, "--device", "cpu")
    serve_worker("--device", "cpu")
    assert built[0] == built[1] == built[2]
    assert built[0] == EngineConfig.from_settings(MODEL, EngineSettings(device="cpu"))


def test_a_value_the_user_passes_wins_over_the_devices_default() -> None:
    default = EngineConfig.from_settings(MODEL, EngineSettings(device="cpu")).scheduler
    chosen = EngineConfig.create(MODEL, device="cpu", max_num_seqs=default.max_num_seqs + 1)
    assert chosen.scheduler.max_num_seqs == default.max_num_seqs + 1
    assert chosen.scheduler.max_num_batched_tokens == default.max_num_batched_tokens


def test_an_unknown_knob_is_named() -> None:
    with pytest.raises(TypeError, match="max_num_sequences"):
        engine_settings(max_num_sequences=4)
    with pytest.raises(TypeError, match="max_num_sequences"):
        EngineSettings().replace(max_num_sequences=4)


def test_settings_take_vllms_names() -> None:
    names = set(EngineSettings().as_kwargs())
    vllm_engine_args = {
        "dtype", "quantization", "kv_cache_dtype", "max_model_len", "gpu_memory_utilization",
        "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "seed", "block_size",
        "num_gpu_blocks_override", "enforce_eager", "tokenizer", "skip_tokenizer_init",
        "async_scheduling", "device",
    }  # fmt: skip
    assert vllm_engine_args <= names
