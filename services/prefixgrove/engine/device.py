"""Host arrays onto the device without making the host wait."""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array to the device without waiting: a pageable source may make the copy wait for the
    stream (the GPU may be steps ahead), so it goes through the pinned pool, which keeps the buffer
    until the copy has run."""
    t = torch.from_numpy(array)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
