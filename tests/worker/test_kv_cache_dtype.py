"""The worker's KV cache dtype: PREFIXGROVE_KV_CACHE_DTYPE / --kv-cache-dtype reaches the engine it
builds, and the engine refuses, by name, a dtype it does not have."""

from __future__ import annotations

import pytest

from prefixgrove import settings as cfg
from prefixgrove.engine.attention.kv_cache import Fp8Cache
from prefixgrove.engine_settings import EngineSettings
from prefixgrove.worker.runner import make_engine


def test_the_worker_engine_caches_in_fp8_when_asked() -> None:
    settings = cfg.load(EngineSettings, env={"PREFIXGROVE_KV_CACHE_DTYPE": "fp8"})
    assert settings.kv_cache_dtype == "fp8"
    assert cfg.load(EngineSettings, env={}).kv_cache_dtype == "auto"
    engine = make_engine("tiny-random-llama", settings.replace(device="cpu"))
    assert engine.config.cache.kv_cache_dtype == "fp8"
    assert isinstance(engine.runner.kv_caches[0][0], Fp8Cache)


def test_an_unknown_kv_cache_dtype_is_named() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        make_engine("tiny-random-llama", EngineSettings(device="cpu", kv_cache_dtype="int8"))
