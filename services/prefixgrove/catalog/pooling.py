"""How a model pools an embedding when a request leaves it to the model: a sentence-transformers
checkout says so in its `modules.json` (a Normalize module: unit-length embeddings) and
`1_Pooling/config.json` (`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`), as
Qwen3-Embedding's and gte-Qwen2's do; any other model pools its last token and normalizes, the
choice of the decoder-based embedding models served here."""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT = ("last", True)


def pooling_defaults(model: str) -> tuple[str, bool]:
    """(pooling type "last" or "mean", whether embeddings are normalized) of `model`."""
    root = Path(model)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return DEFAULT
    try:
        modules = json.loads(modules_file.read_text())
        pooling_dir = next(m["path"] for m in modules if m["type"].endswith(".Pooling"))
        config = json.loads((root / pooling_dir / "config.json").read_text())
    except (OSError, ValueError, KeyError, StopIteration, TypeError):
        return DEFAULT
    normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
    if config.get("pooling_mode_mean_tokens"):
        return "mean", normalize
    return "last", normalize
