"""The inference engine: paged KV cache, prefix-sharing groups, cascade attention, batched sampling."""

from .config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from .core.llm_engine import LLMEngine
from .llm import LLM
from .sampling.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
)
from .sampling.pooling_params import PoolingParams
from .sampling.sampling_params import SamplingParams
from .structured import StructuredOutputsParams

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "ModelConfig",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "StructuredOutputsParams",
]
