"""prefixgrove: offline batch LLM inference for shared-prefix workloads.

`from prefixgrove import LLM, SamplingParams` is the offline API (vLLM-compatible). The engine is imported
on first use, so the planner and the operator load without torch.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
]


def __getattr__(name: str) -> Any:
    if name == "EngineArgs":
        from .engine_args import EngineArgs

        return EngineArgs
    if name in ("TextPrompt", "TokensPrompt"):
        from . import inputs

        return getattr(inputs, name)
    if name in __all__:
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'prefixgrove' has no attribute {name!r}")
