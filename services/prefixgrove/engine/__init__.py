"""The inference engine: paged KV cache, prefix-sharing groups, cascade attention, batched sampling."""

from .config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from .llm import LLM
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams
from .structured import StructuredOutputsParams

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "StructuredOutputsParams",
]
