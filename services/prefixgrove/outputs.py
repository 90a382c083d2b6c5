"""vLLM's `vllm.outputs` import path: what `LLM.generate`, `LLM.chat` and `LLM.embed` hand back."""

from prefixgrove.engine.sampling.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)

__all__ = [
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
]
