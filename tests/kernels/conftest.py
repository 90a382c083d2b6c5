"""Kernel tests run on the GPU when there is one, else in Triton's interpreter on CPU tensors."""

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # NOTE: must happen before any @triton.jit runs; kernel modules imported earlier in the session
    # (by other test folders) were decorated for the GPU, so they are reloaded below.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    for _name in ("merge_states", "paged_attention", "cascade_attention"):
        _module = sys.modules.get(f"prefixgrove.kernels.{_name}")
        if _module is not None:
            importlib.reload(_module)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
