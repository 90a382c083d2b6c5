"""Run by test_tensor_parallel_gpu.py on a machine with GPUs: `python peer_allreduce_check.py N`
starts N ranks that sum known tensors through the peer-memory all-reduce (one-shot and two-shot,
bf16 and fp32, eagerly and replayed from a CUDA graph) and through NCCL, and exits non-zero with
the first difference. A script of its own: spawned ranks must import their entry point by path."""

from __future__ import annotations

import socket
import sys

import torch
import torch.multiprocessing as mp

SHAPES = [(1, 4096), (3, 4096), (64, 4096), (512, 4096), (512, 8192)]


def _inputs(rank: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + shape[0])
    return torch.randn(shape, generator=g).to(dtype)


def _expected(size: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    return sum(_inputs(r, shape, dtype).double() for r in range(size))  # type: ignore[return-value]


def _check(got: torch.Tensor, size: int, shape: tuple[int, int], what: str) -> None:
    want = _expected(size, shape, got.dtype)
    tol = 0.05 if got.dtype == torch.bfloat16 else 1e-5  # bf16 sums of N roundings
    err = (got.double().cpu() - want).abs().max().item()
    if err > tol * size:
        raise AssertionError(f"{what} {shape} {got.dtype}: max error {err}")


def _rank(rank: int, size: int, port: int) -> None:
    from prefixgrove.engine.parallel.launch import join_group

    parallel = join_group(rank, size, "cuda", f"tcp://127.0.0.1:{port}")
    peer = parallel.peer
    assert peer is not None, "these GPUs map each other's memory: the peer all-reduce is expected"
    device = torch.device("cuda", rank)
    for dtype in (torch.bfloat16, torch.float32):
        for shape in SHAPES:
            x = _inputs(rank, shape, dtype).to(device)
            if not peer.takes(x):
                _check(parallel.all_reduce(x.clone()), size, shape, "NCCL fallback")
                continue
            for way in ("one-shot", "two-shot"):
                _check(peer(x, way), size, shape, way)
                _check(_replayed(lambda x=x, way=way: peer(x, way)), size, shape, f"{way} graph")
            _check(parallel.all_reduce(x), size, shape, "the engine's choice")
    parallel.peer = None
    torch.distributed.destroy_process_group()


def _replayed(fn):  # type: ignore[no-untyped-def]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return out


if __name__ == "__main__":
    size = int(sys.argv[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(size, port), nprocs=size)
    print(f"peer all-reduce: {size} ranks agree with the exact sums")
