"""The inference engine: paged KV cache, prefix-sharing groups, cascade attention, batched sampling."""

from .config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from .core.llm_engine import LLMEngine
from .llm import LLM
from .sampling.outputs import CompletionOutput, Logprob, RequestOutput
from .sampling.sampling_params import SamplingParams
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
