"""PoolingParams (vLLM's name): a request that returns its prompt's embedding, pooled from the
model's last hidden states (after its final norm), instead of text.

- pooling_type "last": the last prompt token's hidden state (Qwen3-Embedding, gte-Qwen2 and other
  decoder-based embedding models); "mean": the mean over every prompt token's.
- normalize: the embedding scaled to unit length (L2), after `dimensions`.
- dimensions: only the first `dimensions` values are kept (Matryoshka embeddings).

None takes the model's own choice: its sentence-transformers pooling config where it has one
(catalog/pooling.py), else "last" and normalized. An embedding request runs as a one-token
generation that keeps its pooled hidden state (prompt_logprobs.py records it as the prompt's
rows come through the last layer); "last" shares a group's prefix as any request does, "mean"
needs every prompt row of its own, so it runs outside groups and the prefix cache, as prompt
logprobs do.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: str | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            object.__setattr__(self, "pooling_type", str(self.pooling_type).lower())
        if self.pooling_type not in (None, *POOLING_TYPES):
            raise ValueError(
                f"PoolingParams.pooling_type={self.pooling_type!r} is not supported: expected "
                f"{' or '.join(POOLING_TYPES)} (or None: the model's own)"
            )
        if self.normalize not in (None, True, False):
            raise ValueError(f"PoolingParams.normalize={self.normalize!r} must be a bool or None")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"PoolingParams.dimensions={d!r} must be a positive integer or None")

    @classmethod
    def of(cls, value: Any) -> PoolingParams:
        """`value` itself, or one built from a dict of its fields (batch lines carry a dict)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in fields(cls)})
            if unknown:
                raise ValueError(f"PoolingParams has no field(s) {', '.join(unknown)}")
            return cls(**value)
        raise ValueError(
            f"SamplingParams.pooling must be PoolingParams or a dict of its fields, got "
            f"{type(value).__name__}"
        )

    def resolved(self, pooling_type: str, normalize: bool) -> PoolingParams:
        """These params with the model's choices where they leave them to it."""
        return PoolingParams(
            self.dimensions,
            normalize if self.normalize is None else self.normalize,
            pooling_type if self.pooling_type is None else self.pooling_type,
        )

    def embedding(self, pooled: torch.Tensor, rows: int) -> list[float]:
        """The embedding of a prompt: `pooled` is its last row's hidden state, or (mean) the sum
        of its `rows` rows'; fp32. ValueError where `dimensions` is more than the model has."""
        vector = pooled.float() / rows if self.pooling_type == "mean" else pooled.float()
        if self.dimensions is not None:
            if self.dimensions > vector.numel():
                raise ValueError(
                    f"dimensions={self.dimensions} is more than the model's {vector.numel()}"
                )
            vector = vector[: self.dimensions]
        if self.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return [float(v) for v in vector.tolist()]
