"""This process's place in a tensor-parallel engine, and the collectives its layers call.

One engine of N ranks runs one process per device. Each layer holds its rank's shard (heads, columns,
rows, vocabulary rows) and meets the others in an all-reduce after each row-parallel product and an
all-gather of the vocabulary's logits. On GPUs that map each other's memory the all-reduces of decode-sized
messages go through `peer_allreduce` rather than NCCL. With N = 1 every collective is the identity and nothing of
torch.distributed is touched, so a single-device engine runs exactly as it did.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .peer_allreduce import PeerAllReduce

# torch 2.13 renamed all_gather_into_tensor; the GPU machine's torch 2.11 has only the old name
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TensorParallel:
    def __init__(self, rank: int = 0, size: int = 1, group: Any = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a tensor-parallel group of {size}")
        self.rank = rank
        self.size = size
        self.group = group
        # the all-reduce over peer memory, where the GPUs have one (launch.join_group sets it)
        self.peer: PeerAllReduce | None = None
        # Called with the error when a collective fails (gloo raises when a peer is gone): rank 0
        # finds out which rank was lost and ends the engine (launch.Followers)
        self.on_error: Callable[[BaseException], None] | None = None

    @classmethod
    def single(cls) -> TensorParallel:
        return cls(0, 1)

    def device_of(self, engine_device: str) -> str:
        """This rank's device: the rank-th GPU after the engine's own (cuda:k -> cuda:k+rank), or
        the CPU."""
        if not engine_device.startswith("cuda"):
            return engine_device
        first = int(engine_device.split(":")[1]) if ":" in engine_device else 0
        return f"cuda:{first + self.rank}"

    @property
    def is_leader(self) -> bool:
        """Rank 0: it schedules, samples and owns the host side; the others follow its steps."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks (a row-parallel product's partial sums): in place through NCCL
        or gloo, into a new tensor through peer memory. Callers use the returned tensor."""
        if self.size == 1:
            return x
        if self.peer is not None and self.peer.takes(x):
            return self.peer(x)
        self._collective(dist.all_reduce, x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, cols] on each rank -> [rows, size * cols]: rank r's columns at r * cols."""
        if self.size == 1:
            return x
        rows, cols = x.shape
        stacked = x.new_empty((self.size * rows, cols))  # rank after rank (gloo's layout too)
        self._collective(_all_gather_single, stacked, x.contiguous(), group=self.group)
        return stacked.view(self.size, rows, cols).permute(1, 0, 2).reshape(rows, self.size * cols)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (the step inputs, a window's sampled tokens)."""
        if self.size > 1:
            self._collective(dist.broadcast, x, src=0, group=self.group)
        return x

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value`: one rank's shortage (KV blocks) is every rank's."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        self._collective(dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def _collective(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            call(*args, **kwargs)
        except Exception as error:
            if self.on_error is not None:
                self.on_error(error)
            raise
