"""vLLM's `vllm.sampling_params` import path: `from prefixgrove.sampling_params import SamplingParams`
ports a script by changing its import. GuidedDecodingParams is vLLM's name before 0.11."""

from prefixgrove.engine.sampling.pooling_params import PoolingParams
from prefixgrove.engine.sampling.sampling_params import SamplingParams
from prefixgrove.engine.structured.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "PoolingParams", "SamplingParams", "StructuredOutputsParams"]
