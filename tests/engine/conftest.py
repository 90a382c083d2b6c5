"""Engine tests run on the CPU in fp32; the Triton backend runs in Triton's interpreter (switched on in
tests/conftest.py)."""

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_checkpoints import SMOLLM2, SharedEngines, save_checkpoint, smollm2_file

from prefixgrove.catalog.presets import load_tokenizer


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The models here are tiny: intra-op threads only contend for the machine's few shared cores (a
    decode step took 25x longer with two threads than with one under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama 3 checkpoint (llama3 rope scaling, tied embeddings) with well-separated logits."""
    return save_checkpoint("llama3", tmp_path_factory.mktemp("llama3"))


@pytest.fixture(scope="module")
def smollm2_engines() -> Iterator[SharedEngines]:
    """SmolLM2 engines shared by the module's tests (engine_checkpoints.SharedEngines says how)."""
    smollm2_file()
    engines = SharedEngines()
    yield engines
    engines.close()


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """The trained model's tokenizer, loaded once for the modules that build its chat prompts."""
    smollm2_file()
    return load_tokenizer(SMOLLM2)
