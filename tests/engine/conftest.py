"""Engine tests run on the CPU in fp32; the Triton backend runs in Triton's interpreter."""

import importlib
import os
import sys

# NOTE: must happen before triton is imported anywhere; kernel modules that another test folder imported
# first were decorated for the GPU, so they are reloaded under the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
for _name in ("merge_states", "paged_attention", "cascade_attention"):
    _module = sys.modules.get(f"prefixgrove.kernels.{_name}")
    if _module is not None:
        importlib.reload(_module)

import pytest  # noqa: E402
import torch  # noqa: E402
from engine_checkpoints import save_checkpoint  # noqa: E402


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
