"""Suite-wide setup. Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the switch
must be thrown before the first `@triton.jit` runs, which is why it lives here, at the root."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from services_testbed import RedisServer, need_redis

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run on the GPU machine; elsewhere they are skipped, never failed."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, killed at teardown (services_testbed.py)."""
    server = RedisServer(need_redis(), tmp_path)
    server.start()
    yield server
    server.kill()
