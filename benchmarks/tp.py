"""Tensor parallelism on one machine's GPUs: throughput and scaling, the all-reduce's cost, and
agreement with one GPU.

  canonical  the canonical job (batchllm.py's group-cascade mode) at each --tp-sizes, each in its
             own process; per GPU req/s and scaling efficiency against the first size (1, or the
             smallest that fits, scaled by --flops-ratio when that size ran another model); above
             one GPU, a full decode step's all-reduces timed right after, and their share of the
             run's mean decode step
  allreduce  the all-reduce of one decode step's hidden states ([rows, hidden] bf16) on --tp-sizes
             GPUs, replayed from a CUDA graph as the decode graphs replay it: microseconds each,
             and per decode step (two per layer, one for the embedding), for each of --ways
             (NCCL, the peer-memory one-shot and two-shot, and `auto`, the engine's choice)
  agreement  teacher-forced top-1 agreement of TP = N with TP = 1 in bf16: TP = 1 generates
             greedily, TP = N scores the same sequences (prompt logprobs); the share of generated
             positions whose top-1 is the token TP = 1 chose
Prints one JSON line per measurement; flags a mode does not know go on to the runs it starts (the
engine's, batchllm.py's). Usage:
  python benchmarks/tp.py canonical --tp-sizes 1,2,4 [--groups 400] [--baseline-req-per-s X] [engine flags]
  python benchmarks/tp.py allreduce --tp-sizes 2,4 [--hidden 4096 --layers 32] [--ways nccl,auto]
  python benchmarks/tp.py agreement --tp-sizes 2,4 [--model llama-3.1-8b-random]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from _common import device_name, emit, ensure_prefixgrove

HERE = Path(__file__).resolve().parent


def _child(script: str, args: list[str]) -> list[dict[str, Any]]:
    """Runs a benchmark in its own process (each size starts and ends its own ranks) and returns
    its JSON lines."""
    out = subprocess.run(  # its stderr passes through: a failing size says why
        [sys.executable, str(HERE / script), *args], check=True, stdout=subprocess.PIPE, text=True
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def canonical(args: argparse.Namespace, engine_flags: list[str]) -> None:
    base: dict[str, Any] | None = None
    for size in args.tp_sizes:
        flags = [*engine_flags, "--tensor-parallel-size", str(size), "--groups", str(args.groups)]
        (record,) = _child("batchllm.py", ["--modes", "group-cascade", *flags])
        record.update(tensor_parallel_size=size, gpus=size)
        record["req_per_s_per_gpu"] = record["requests_per_s"] / size
        if base is None:  # the first size, or TP = 1's figure from a run of its own
            base = (
                {"req_per_s_per_gpu": args.baseline_req_per_s}
                if args.baseline_req_per_s
                else record
            )
        record["scaling_efficiency"] = (
            record["req_per_s_per_gpu"] * args.flops_ratio / base["req_per_s_per_gpu"]
        )
        if size > 1:
            record.update(_allreduce_share(record, size, args.model))
        emit({"bench": "tp.canonical", **record})


def _allreduce_share(record: dict[str, Any], size: int, model: str) -> dict[str, float]:
    """A full decode step's all-reduces (max_num_seqs rows, the way the engine takes), timed on the
    same GPUs right after the run, against the run's mean decode step: an upper bound of their
    share, since the mean step includes the smaller batches of a job's tail."""
    from prefixgrove.catalog.presets import load_hf_config

    config = load_hf_config(model)
    try:  # the run's record stands without it
        (measured,) = _child("tp.py", [
            "allreduce", "--tp-sizes", str(size), "--rows", str(record["max_num_seqs"]),
            "--ways", "auto", "--hidden", str(config.hidden_size),
            "--layers", str(config.num_hidden_layers),
        ])  # fmt: skip
    except subprocess.CalledProcessError as error:
        print(
            f"tp.py: the all-reduce timing failed ({error}); the record goes without it",
            file=sys.stderr,
        )
        return {}
    step_us = record["decode_seconds"] / record["decode_steps"] * 1e6
    return {
        "decode_ms_per_step": round(step_us / 1000, 3),
        "allreduce_us_per_full_decode_step": round(measured["us_per_decode_step"], 1),
        "allreduce_share_of_decode_step": round(measured["us_per_decode_step"] / step_us, 4),
    }


def allreduce(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    for size in args.tp_sizes:
        with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
            mp.spawn(_allreduce_rank, args=(size, args, f.name), nprocs=size)
            for line in f.read().splitlines():
                emit(json.loads(line))


def _allreduce_rank(rank: int, size: int, args: argparse.Namespace, path: str) -> None:
    ensure_prefixgrove()
    from prefixgrove.engine.parallel.group import TensorParallel
    from prefixgrove.engine.parallel.launch import join_group

    port = 29600 + size
    parallel = join_group(rank, size, "cuda", f"tcp://127.0.0.1:{port}")
    peer = parallel.peer
    nccl = TensorParallel(rank, size, parallel.group)  # the same group, NCCL only
    ways = {
        "nccl": nccl.all_reduce,
        "auto": parallel.all_reduce,  # what the engine calls: peer memory where it takes x
        "one-shot": lambda x: peer(x, "one-shot"),  # type: ignore[misc]
        "two-shot": lambda x: peer(x, "two-shot"),  # type: ignore[misc]
    }
    for rows in args.rows:
        x = torch.randn(rows, args.hidden, dtype=torch.bfloat16, device=f"cuda:{rank}")
        for way in args.ways:
            if way in ("one-shot", "two-shot") and (peer is None or not peer.takes(x)):
                continue  # a message the peer buffer does not take, or no peer memory here
            us = _graphed_us(lambda x=x, way=way: ways[way](x), reps=50)
            if rank == 0:
                _append(path, {
                    "bench": "tp.allreduce", "device": device_name(), "tensor_parallel_size": size,
                    "way": way, "rows": rows, "hidden": args.hidden,
                    "bytes": x.numel() * x.element_size(), "us_per_allreduce": us,
                    "us_per_decode_step": us * (2 * args.layers + 1),
                })  # fmt: skip
    parallel.peer = None  # its buffer goes before the group
    torch.distributed.destroy_process_group()


def _append(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _graphed_us(fn: Any, reps: int) -> float:
    """Microseconds per call of `fn` captured `reps` times in one CUDA graph (as a decode graph
    holds its all-reduces)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * reps)


def agreement(args: argparse.Namespace, engine_flags: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sequences = os.path.join(tmp, "sequences.json")
        shape = ["--sequences", str(args.sequences), "--output-len", str(args.output_len)]
        _child("tp.py", ["_generate", "--out", sequences, *shape, *engine_flags])
        for size in args.tp_sizes:
            run = ["_score", "--out", sequences, "--tp", str(size), *shape, *engine_flags]
            (record,) = _child("tp.py", run)
            emit(record)


def _generate(args: argparse.Namespace, engine_flags: list[str]) -> None:
    """TP = 1's greedy continuations of random prompts, saved for the scoring runs."""
    from _common import greedy_params, make_llm, random_prompts

    llm = make_llm(args)
    prompts = random_prompts(args.sequences, 64, llm.config.model.arch.vocab_size, seed=1)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy_params(args.output_len), use_tqdm=False
    )
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    Path(args.out).write_text(json.dumps({"prompts": prompts, "sequences": seqs}))


def _score(args: argparse.Namespace, engine_flags: list[str]) -> None:
    from _common import make_llm, prompt_scores, teacher_forced, top1

    saved = json.loads(Path(args.out).read_text())
    llm = make_llm(args, tensor_parallel_size=args.tp)
    scores = prompt_scores(llm, saved["sequences"])
    prompts, seqs = saved["prompts"], saved["sequences"]
    agree = total = 0
    for i, token, _, ours in teacher_forced(prompts, seqs, scores, scores):
        agree += top1(ours[i]) == token
        total += 1
    emit(
        {
            "bench": "tp.agreement",
            "device": device_name(),
            "model": args.model,
            "dtype": str(llm.config.model.dtype),
            "tensor_parallel_size": args.tp,
            "positions": total,
            "top1_agreement": agree / total,
        }
    )
    llm.engine.close()


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _parser() -> argparse.ArgumentParser:
    """This script's own options, per mode. Everything else on the command line (the engine's
    flags, batchllm.py's workload flags) passes through to the runs each mode starts."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = ap.add_subparsers(dest="what", required=True)
    canonical = modes.add_parser("canonical", help="the canonical job at each TP size")
    canonical.add_argument("--groups", type=int, default=400)
    canonical.add_argument("--flops-ratio", type=float, default=1.0, help="70B's over 8B's")
    canonical.add_argument(
        "--baseline-req-per-s",
        type=float,
        default=0.0,
        help="TP = 1's req/s measured apart (default: the first size's)",
    )
    allreduce = modes.add_parser("allreduce", help="one decode step's all-reduce, each way")
    allreduce.add_argument("--hidden", type=int, default=4096)
    allreduce.add_argument("--layers", type=int, default=32)
    allreduce.add_argument("--rows", type=_sizes, default=[1, 64, 512])
    allreduce.add_argument(
        "--ways",
        type=lambda s: s.split(","),
        default=["nccl", "one-shot", "two-shot", "auto"],
        help="NCCL, peer memory one-shot / two-shot, and the engine's choice",
    )
    agreement = modes.add_parser("agreement", help="TP = N's top-1 against TP = 1's, in bf16")
    for mode in (canonical, allreduce, agreement):
        mode.add_argument("--tp-sizes", type=_sizes, default=[1, 2])
    runs = [modes.add_parser(name) for name in ("_generate", "_score")]  # agreement's processes
    for run in runs:
        run.add_argument("--out", required=True)
        run.add_argument("--tp", type=int, default=1)
    for mode in (agreement, *runs):
        mode.add_argument("--sequences", type=int, default=32)
        mode.add_argument("--output-len", type=int, default=64)
    return ap  # fmt: skip


def main() -> None:
    ensure_prefixgrove()
    from _common import add_engine_args

    args, passthrough = _parser().parse_known_args()
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)
    args = argparse.Namespace(**{**vars(engine.parse_known_args(passthrough)[0]), **vars(args)})
    {
        "canonical": lambda: canonical(args, passthrough),
        "allreduce": lambda: allreduce(args),
        "agreement": lambda: agreement(args, passthrough),
        "_generate": lambda: _generate(args, passthrough),
        "_score": lambda: _score(args, passthrough),
    }[args.what]()


if __name__ == "__main__":
    main()
