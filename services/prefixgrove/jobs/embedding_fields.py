"""A `/v1/embeddings` line's body (OpenAI's, with vLLM's extra fields) -> the params of its request.

`input` is a text, a list of token ids, or a list of either (each embedded, `data` indexed in input
order: prompt_parts.py); `dimensions` keeps the embedding's first values (Matryoshka),
`encoding_format` "float" (the default) or "base64" (the float32 values' little-endian bytes),
vLLM's `normalize` (default: the model's own) and `truncate_prompt_tokens`. An embedding runs as
a one-token generation whose prompt's pooled hidden state is kept (SamplingParams.pooling; the
engine's pooling_params.py).
"""

from __future__ import annotations

from typing import Any

from prefixgrove.jobs.request_body import INT32_MAX
from prefixgrove.jobs.request_errors import InvalidRequest, is_int, shown
from prefixgrove.jobs.vllm_fields import add_truncate_prompt_tokens

MAX_INPUTS = 2048  # OpenAI's bound on inputs per request


def embedding_params(body: dict[str, Any]) -> dict[str, Any]:
    """The request's SamplingParams keyword arguments (and `encoding_format`), JSON-serialisable."""
    pooling: dict[str, Any] = {}
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if not is_int(dimensions) or not 1 <= dimensions <= INT32_MAX:
            raise InvalidRequest(
                "invalid_value",
                f"dimensions must be a positive integer, got {shown(dimensions)}",
            )
        pooling["dimensions"] = dimensions
    normalize = body.get("normalize")
    if normalize is not None:
        if not isinstance(normalize, bool):
            raise InvalidRequest(
                "invalid_value", f"normalize must be a boolean, got {shown(normalize)}"
            )
        pooling["normalize"] = normalize
    params: dict[str, Any] = {"max_tokens": 1, "temperature": 0.0, "detokenize": False,
                              "pooling": pooling}  # fmt: skip
    form = body.get("encoding_format")
    if form not in (None, "float", "base64"):
        raise InvalidRequest(
            "invalid_value", f"encoding_format must be 'float' or 'base64', got {shown(form)}"
        )
    if form == "base64":
        params["encoding_format"] = "base64"
    add_truncate_prompt_tokens(params, body)
    return params
