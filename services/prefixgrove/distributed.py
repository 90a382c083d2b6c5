"""vLLM's `vllm.distributed` import path, for the one function its offline examples call between
two engines in one process."""

from __future__ import annotations

import gc


def cleanup_dist_env_and_memory() -> None:
    """Frees what an engine that was deleted still holds: its objects now, its GPU memory back to
    the device."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
