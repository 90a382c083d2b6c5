"""Kernel tests run on the GPU when there is one, else in Triton's interpreter on CPU tensors (switched on
in tests/conftest.py, before any kernel module is imported)."""

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
