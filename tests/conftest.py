"""Suite-wide setup. Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the switch
must be thrown before the first `@triton.jit` runs, which is why it lives here, at the root."""

import ctypes
import functools
import gc
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


# A test after which the process is this much larger than after the last collection triggers one.
GC_GROWTH_BYTES = 512 * 2**20


def resident_bytes() -> int:
    """This process's resident memory now (Linux; 0 elsewhere, which never triggers a collection)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # no glibc
        return None
    return trim


def give_back_free_memory() -> None:
    """Hands the allocator's free pages back to the system. glibc keeps what torch frees in its
    arenas (one per thread that allocated) for reuse, and much of it is never reused: without
    this, the process stayed at the high-water mark of every engine module before, gigabytes
    of pages that nothing held."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@pytest.fixture(scope="module", autouse=True)
def memory_back_after_each_module() -> Iterator[None]:
    """Once a module's fixtures are torn down its engines are freed; their memory goes back to the
    system before the next module, so module peaks do not stack."""
    yield
    give_back_free_memory()


@pytest.fixture(scope="session")
def resident_floor() -> list[int]:
    """The process's smallest resident size since the last garbage collection that the fixture
    below ran."""
    return [resident_bytes()]


@pytest.fixture(autouse=True)
def collect_dropped_engines(resident_floor: list[int]) -> Iterator[None]:
    """An engine that a test dropped while it sat in a reference cycle (a test's patch of one of
    its methods wrapping the original, say) keeps its weights and KV cache until a full garbage
    collection, and LLM.generate thaws every object into the oldest generation, which Python
    collects rarely: dozens of such engines piled up to gigabytes. A full collection costs about
    a second here, so it runs only after a test that grew the process by GC_GROWTH_BYTES."""
    yield
    now = resident_bytes()
    if now - resident_floor[0] > GC_GROWTH_BYTES:
        gc.collect()
        give_back_free_memory()
        resident_floor[0] = resident_bytes()
    else:
        resident_floor[0] = min(resident_floor[0], now)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, killed at teardown (services_testbed.py)."""
    server = RedisServer(need_redis(), tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture(autouse=True)
def _logging_as_before() -> Iterator[None]:
    """The CLI's main() points the root logger at the stderr of its test: each test leaves the
    root logger as it found it, so a later test's logs never go to a closed stream."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


@pytest.fixture(scope="session", autouse=True)
def _gguf_tensors_read_once() -> Iterator[None]:
    """The trained SmolLM2's GGUF file is dequantized once per test process, not once per engine:
    most of an engine's build went into reading it. The loader copies every tensor into its own
    parameters (load_weights), so engines never share what is kept here."""
    from prefixgrove.catalog import gguf

    read = gguf.iter_tensors
    kept: dict[tuple[str, str], list[tuple[str, torch.Tensor]]] = {}

    def read_once(
        path: str, device: str | torch.device, cut_of: Any = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if cut_of is not None:  # one tensor-parallel rank's part: read as asked
            return read(path, device, cut_of)
        key = (str(path), str(device))
        if key not in kept:
            kept[key] = list(read(path, device))
        return iter(kept[key])

    gguf.iter_tensors = read_once
    yield
    gguf.iter_tensors = read
