"""An all-reduce that reads the other GPUs' memory directly, for the small messages of decode steps.

A decode step's all-reduces carry a few MB at most (two per layer, [rows, hidden]), and there NCCL's
fixed cost per call is most of the time, a large share of a step once the matmuls are split N ways.
vLLM and SGLang answer with their own all-reduce over peer memory; this is ours, on torch's
symmetric memory: each rank allocates one buffer that every other rank maps, so a kernel reads its
peers' partial sums over NVLink with plain loads.

- one-shot: each rank copies its partial sum into its buffer, meets the others at a barrier, and
  sums all N buffers itself. One kernel, N reads of the message: best for small messages.
- two-shot: each rank sums one N-th of the message from every buffer, then gathers the other ranks'
  sums. Less traffic, one more barrier: better for the largest decode messages (from 2 MiB at
  N = 2 on H200s: 26.6 us for a 512-row 8B step against one-shot's 35.1 and NCCL's 40.2).

Both are one kernel launch with barriers in and out on signal pads, so CUDA graphs capture them
like any kernel, and a buffer is never rewritten while a peer still reads it. Multicast (NVLS) is
never used: the GPU machines keep it off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1).

What does not fit (a message over the buffer, a dtype the kernels do not take, a machine whose GPUs
cannot map each other's memory) takes NCCL, as does every engine started with
disable_custom_all_reduce. As the engine starts, every rank sums known integers both ways and
through NCCL (`sums_what_nccl_sums`): one rank's difference sends every rank back to NCCL. Which
way a size takes is `choose_way`.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .group import TensorParallel

logger = logging.getLogger(__name__)

# The largest message taken: a 70B decode step of 512 rows (512 x 8,192 bf16) is 8 MiB.
MAX_BYTES = 8 << 20
WAYS = ("one-shot", "two-shot")
_DTYPES = (torch.bfloat16, torch.float32)  # what torch's symmetric-memory kernels dispatch on


def choose_way(nbytes: int, ranks: int) -> str:
    """One-shot reads N messages per rank, two-shot about two but with one more barrier: one-shot
    wins while the barriers and the launch dominate. Measured on two H200s (`tp.py allreduce`,
    RESULTS.md): one-shot is faster up to 1 MiB (14.7 against 15.7 us), two-shot from 2 MiB (18.9
    against 21.4 us; 26.6 against 35.1 at 4 MiB). At 4 ranks one-shot reads twice as much, so
    two-shot takes over sooner: 512 KB there is vLLM's and SGLang's choice, not yet measured here."""
    return "one-shot" if nbytes <= _ONE_SHOT_UP_TO.get(ranks, 512 << 10) else "two-shot"


_ONE_SHOT_UP_TO = {2: 1 << 20}


class PeerAllReduce:
    """One rank's symmetric buffer and the sums through it. `create` builds one on every rank or on
    none (a collective: every rank of the group calls it)."""

    def __init__(self, group: Any, device: torch.device, max_bytes: int = MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name: str = group.group_name
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        with warnings.catch_warnings():  # a no-op (deprecated) on newer torch, needed on older
            warnings.simplefilter("ignore")
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(self.group_name)
        handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self.ranks: int = handle.world_size
        self._ops = torch.ops.symm_mem

    @classmethod
    def create(cls, parallel: TensorParallel, device: torch.device) -> PeerAllReduce | None:
        """This rank's, when every rank can map every other's memory and sums as NCCL does; else
        None on every rank (a collective: every rank of `parallel` calls it)."""
        devices = torch.empty(parallel.size, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(
            devices, torch.tensor([device.index], device=device), group=parallel.group
        )
        peers = [d for d in devices.tolist() if d != device.index]
        usable = _symmetric_memory_ops() and all(
            torch.cuda.can_device_access_peer(device, p) for p in peers
        )
        if not _every_rank(parallel, usable, device):
            logger.info("peer all-reduce unavailable here (no symmetric memory or P2P): NCCL")
            return None
        try:
            peer: PeerAllReduce | None = cls(parallel.group, device)
        except Exception as error:  # any failure to map the buffers leaves NCCL
            logger.warning("peer all-reduce could not map the ranks' buffers (%s): NCCL", error)
            peer = None
        if not _every_rank(parallel, peer is not None, device):
            return None
        assert peer is not None
        return (
            peer
            if _every_rank(parallel, peer.sums_what_nccl_sums(parallel, device), device)
            else None
        )

    def sums_what_nccl_sums(self, parallel: TensorParallel, device: torch.device) -> bool:
        """Both ways give NCCL's sums, to the bit, of integers fp32 adds exactly (a small and a
        decode-sized message): checked once as the engine starts, on every rank at once, so that
        a machine where the peer reads go wrong keeps NCCL rather than wrong activations."""
        right = True
        for numel in (1024, 1 << 20):  # every rank makes every call: no early way out
            x = (torch.arange(numel, device=device) % 251 + 7 * parallel.rank).float()
            want = x.clone()
            dist.all_reduce(want, group=parallel.group)
            for way in WAYS:
                if not torch.equal(self(x, way), want):
                    logger.warning("peer all-reduce (%s) differs from NCCL here: NCCL", way)
                    right = False
        return right

    def takes(self, x: torch.Tensor) -> bool:
        return (
            x.dtype in _DTYPES
            and x.is_contiguous()
            and x.numel() * x.element_size() <= self.max_bytes
        )

    def __call__(self, x: torch.Tensor, way: str | None = None) -> torch.Tensor:
        """The sum of `x` over the ranks, in a new tensor (the caller checked `takes(x)`)."""
        way = way or choose_way(x.numel() * x.element_size(), self.ranks)
        flat, out = x.view(-1), torch.empty_like(x)
        staged = self.buffer.view(x.dtype)[: flat.numel()]  # offset 0: the op finds its peers'
        if way == "one-shot":
            self._ops.one_shot_all_reduce_copy_out(
                staged, flat, "sum", self.group_name, out.view(-1)
            )
        elif way == "two-shot":
            staged.copy_(flat)
            self._ops.two_shot_all_reduce_out(staged, "sum", self.group_name, out.view(-1))
        else:
            raise ValueError(f"all-reduce way {way!r}: expected one of {WAYS}")
        return out


def _every_rank(parallel: TensorParallel, yes: bool, device: torch.device) -> bool:
    """Whether every rank said yes: one rank's no is everyone's."""
    return parallel.min_over_ranks(int(yes), device) == 1


def _symmetric_memory_ops() -> bool:
    try:
        import torch.distributed._symmetric_memory  # its Python side defines ops of its own
    except ImportError:
        return False
    ops = torch.ops.symm_mem
    return all(
        hasattr(ops, name) for name in ("one_shot_all_reduce_copy_out", "two_shot_all_reduce_out")
    )
