"""The peer-memory all-reduce's choices that the CPU can check: which way a message takes, and the
start-up check that keeps NCCL where the peer reads give other sums (two gloo ranks stand in for
the GPUs; the kernels themselves run in test_tensor_parallel_gpu.py)."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from prefixgrove.engine.parallel.group import TensorParallel
from prefixgrove.engine.parallel.peer_allreduce import MAX_BYTES, PeerAllReduce, choose_way


def test_one_shot_for_small_messages_two_shot_for_the_largest() -> None:
    # two ranks: measured on H200s, one-shot up to 1 MiB, two-shot from 2 MiB
    assert choose_way(128 * 4096 * 2, 2) == "one-shot"  # a 128-row 8B decode step
    assert choose_way(256 * 4096 * 2, 2) == "two-shot"
    assert choose_way(MAX_BYTES, 2) == "two-shot"
    assert choose_way(64 * 4096 * 2, 4) == "one-shot"  # a 64-row decode step: latency-bound
    assert choose_way(512 * 4096 * 2, 4) == "two-shot"  # 512 rows: a quarter of the reads


class _Summing(PeerAllReduce):
    """Sums as NCCL does (through the group), without symmetric memory."""

    def __init__(self) -> None:  # no buffers to map
        pass

    def __call__(self, x: torch.Tensor, way: str | None = None) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out)
        return out


class _Wrong(_Summing):
    """Right on one way, wrong on the other (a peer read that lands on a stale buffer)."""

    def __call__(self, x: torch.Tensor, way: str | None = None) -> torch.Tensor:
        out = super().__call__(x, way)
        return out if way == "one-shot" else out + (dist.get_rank() == 1)


def _rank(rank: int, port: int, answers: list[bool]) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        parallel, cpu = TensorParallel(rank, 2, dist.group.WORLD), torch.device("cpu")
        right = _Summing().sums_what_nccl_sums(parallel, cpu)
        wrong = _Wrong().sums_what_nccl_sums(parallel, cpu)
        assert (right, wrong) == tuple(answers), (rank, right, wrong)
        # rank 1 alone saw its wrong sums: the agreement create() takes makes its no everyone's
        assert parallel.min_over_ranks(int(right), cpu) == 1
        assert parallel.min_over_ranks(int(wrong), cpu) == 0
    finally:
        dist.destroy_process_group()


def test_the_start_up_check_keeps_nccl_where_a_way_sums_otherwise() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_1_wrong, args=(port,), nprocs=2)


def _rank_1_wrong(rank: int, port: int) -> None:
    _rank(rank, port, [True, rank == 0])
