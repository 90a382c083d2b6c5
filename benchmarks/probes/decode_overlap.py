"""Can a decode step's memory-bound attention hide under its compute-bound matmuls? A probe on the GPU.

A decode step of the canonical workload (512 requests) spends about as long in matmuls (compute-bound at
512 rows) as in cascade attention (bound by HBM bandwidth), one after the other. Splitting the batch into
two halves whose layers run on two CUDA streams lets one half's attention run beside the other half's
matmuls, at the price of reading the weights twice. This script measures whether the hardware actually
overlaps them, before any engine code is built on the idea: the 32 layers' matmuls (Llama-3.1-8B shapes,
one weight set per layer) and cascade decode attention (groups of --degree over a --prefix-len prefix,
--own-tokens own keys) per step, captured in CUDA graphs, as

  matmuls / attention      each alone, the whole batch
  serial                   the whole batch, layer by layer (what the engine does today)
  halves_serial            two half batches one after the other on one stream
  halves_concurrent        the two halves on two streams, joined at the end of the step

and prints one JSON line per batch size with milliseconds per step (median of --rounds rounds, the
variants alternating so that the board's power state is shared) and the SM clock after each.
Usage: cd benchmarks && python -m probes.decode_overlap [--batches 512,1024] [--attention two-pass|one-pass]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from attention_kernels import Workload
from attention_kernels import parse_args as attention_args
from probes.matmul_shapes import SHAPES, sm_clock_mhz

from _common import as_graph, cuda_ms_per_call, device_name, emit

LAYERS = 32
LAYER_SHAPES = [SHAPES[name] for name in ("qkv", "o", "gate_up", "down")]


class Half:
    """One batch's activations and attention workload; `layer(i)` runs layer i's matmuls and attention."""

    def __init__(
        self, rows: int, weights: list[list[torch.Tensor]], ns: argparse.Namespace
    ) -> None:
        self.weights = weights
        self.inputs = [
            torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _, k in LAYER_SHAPES
        ]
        ns.requests = rows
        self.attention = Workload(ns, ns.degree, ns.prefix_len)
        self.attend = (
            self.attention.one_pass if ns.attention == "one-pass" else self.attention.cascade
        )

    def matmuls(self, layer: int) -> None:
        for x, w in zip(self.inputs, self.weights[layer], strict=True):
            F.linear(x, w)

    def step(self, with_matmuls: bool = True, with_attention: bool = True) -> None:
        for layer in range(LAYERS):
            if with_matmuls:
                self.matmuls(layer)
            if with_attention:
                self.attend()


def two_streams(a: Half, b: Half) -> Callable[[], None]:
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def body() -> None:
        main = torch.cuda.current_stream()
        for stream, half in zip(streams, (a, b), strict=True):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                half.step()
        for stream in streams:
            main.wait_stream(stream)

    return body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="512,1024")
    ap.add_argument("--degree", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--own-tokens", type=int, default=250, help="mid-decode: 200 prompt + ~50 new")
    ap.add_argument("--attention", choices=["two-pass", "one-pass"], default="two-pass")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ns = attention_args([])
    ns.degree, ns.prefix_len, ns.own_tokens, ns.attention = (
        args.degree, args.prefix_len, args.own_tokens, args.attention,
    )  # fmt: skip
    weights = [
        [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in LAYER_SHAPES]
        for _ in range(LAYERS)
    ]
    for batch in [int(b) for b in args.batches.split(",")]:
        emit(measure(batch, weights, ns, args))
        torch.cuda.empty_cache()


def measure(
    batch: int, weights: list[list[torch.Tensor]], ns: argparse.Namespace, args: argparse.Namespace
) -> dict[str, object]:
    whole = Half(batch, weights, ns)
    a, b = Half(batch // 2, weights, ns), Half(batch - batch // 2, weights, ns)

    def halves_in_turn() -> None:
        a.step()
        b.step()

    graphs = {
        "matmuls": as_graph(lambda: whole.step(with_attention=False)),
        "attention": as_graph(lambda: whole.step(with_matmuls=False)),
        "serial": as_graph(whole.step),
        "halves_serial": as_graph(halves_in_turn),
        "halves_concurrent": as_graph(two_streams(a, b)),
    }
    times: dict[str, list[float]] = {name: [] for name in graphs}
    clocks: dict[str, int | None] = {}
    for _ in range(args.rounds):
        for name, graph in graphs.items():
            times[name].append(cuda_ms_per_call(graph, args.replays))
            clocks[name] = sm_clock_mhz()
    ms = {name: round(statistics.median(t), 3) for name, t in times.items()}
    return {
        "device": device_name(),
        "batch": batch,
        "attention": args.attention,
        "degree": args.degree,
        "prefix_len": args.prefix_len,
        "own_tokens": args.own_tokens,
        "ms_per_step": ms,
        "all_ms": {name: [round(t, 3) for t in ts] for name, ts in times.items()},
        "sm_clock_mhz_after": clocks,
        "concurrent_vs_serial": round(ms["serial"] / ms["halves_concurrent"], 3),
        "sum_of_parts_ms": round(ms["matmuls"] + ms["attention"], 3),
    }


if __name__ == "__main__":
    main()
