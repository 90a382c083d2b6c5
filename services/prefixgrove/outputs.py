"""vLLM's `vllm.outputs` import path: what `LLM.generate` and `LLM.chat` hand back."""

from prefixgrove.engine.sampling.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)

__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput"]
