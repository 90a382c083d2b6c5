"""Where a decode step's time goes: torch profiler over a few decode-only steps of the 8B model.

Prints the top CUDA kernels and the step's wall time, GPU busy time and CPU time, for the plain path and
(with --groups) the cascade path. Usage: cd benchmarks && python -m probes.profile_decode [--batch 256] [--context 1000]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from prefixgrove import LLM, SamplingParams

from _common import device_name, emit, queue_job, shared_prefix_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b-random", help="a model preset's name")
    ap.add_argument("--batch", type=int, default=256, help="sequences decoded a step")
    ap.add_argument("--prefix-len", type=int, default=0, help="shared prefix (0: no sharing)")
    ap.add_argument("--per-group", type=int, default=16, help="requests sharing one prefix")
    ap.add_argument("--suffix-len", type=int, default=1000, help="prompt tokens after the prefix")
    ap.add_argument("--steps", type=int, default=8, help="decode steps profiled, after 3 warm")
    ap.add_argument("--cascade", type=int, choices=[0, 1], default=1, help="cascade attention")
    args = ap.parse_args()
    llm = LLM(
        args.model,
        dtype="bfloat16",
        max_num_seqs=args.batch,
        max_num_batched_tokens=16384,
        enable_cascade_attention=bool(args.cascade),
    )
    groups = args.batch // args.per_group if args.prefix_len else args.batch
    per_group = args.per_group if args.prefix_len else 1
    prompts = shared_prefix_prompts(groups, per_group, args.prefix_len, args.suffix_len, 128256, 0)
    engine = llm.engine
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, detokenize=False)
    queue_job(llm, prompts, params, grouped=bool(args.prefix_len))
    while not all(s.is_decoding for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / args.steps
    print(events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
    emit(
        {
            "benchmark": "profile_decode",
            "device": device_name(),
            "batch": args.batch,
            "prefix_len": args.prefix_len,
            "suffix_len": args.suffix_len,
            "cascade": args.cascade,
            "wall_ms_per_step": round(wall * 1000, 2),
            "gpu_busy_ms_per_step": round(gpu_us / 1000, 2),
        }
    )


if __name__ == "__main__":
    main()
