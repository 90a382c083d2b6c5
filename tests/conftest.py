"""Suite-wide setup. Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the switch
must be thrown before the first `@triton.jit` runs, which is why it lives here, at the root."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
