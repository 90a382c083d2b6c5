"""Decode-heavy throughput (issue "Multi-step decoding"): Llama-3.1-8B shapes, random weights, bf16, 1,024
requests of 128 random prompt tokens and 1,024 output tokens, EOS ignored.

For each configuration (decode steps per CPU round trip N, eager or CUDA graphs) on a fresh engine in this one
process: output tokens/s over the whole run, and the share of decode wall time in which the GPU is idle,
measured with the torch profiler tracing kernels only, over 16 engine steps of pure decode (the union of
kernel intervals against wall time; the tracing's own small CPU cost makes this an upper bound).
Usage: python benchmarks/decode.py [--configs 1:eager,1:graphs,8:eager,8:graphs] [--output-len 1024]
       [--quantization fp8] [--kv-cache-dtype fp8]   (FP8 W8A8, an FP8 KV cache; lines name both)
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from prefixgrove import LLM, SamplingParams

from _common import (
    add_random_workload_args,
    device_name,
    emit,
    greedy_params,
    make_llm,
    random_prompts,
    timed,
)


def gpu_idle_share(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    """Fills the engine with decoding requests, then profiles `steps` engine steps of pure decode."""
    engine = llm.engine
    limit = llm.config.model.max_model_len - max(map(len, prompts)) - 1
    params = greedy_params(min(10_000, limit))  # more steps than are profiled, within the context
    for i, p in enumerate(prompts):
        engine.add_request(f"idle-{i}", p, params)
    while engine.scheduler.waiting or not all(s.is_decoding for s in engine.scheduler.running):
        engine.step()
    engine.step()
    torch.cuda.synchronize()
    # Kernel tracing only: CPU-side tracing would slow the very host work whose gaps are measured.
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    intervals = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    )
    busy, end = 0.0, float("-inf")
    for s, e in intervals:  # union of kernel intervals
        if e > end:
            busy += e - max(s, end)
            end = e
    engine.abort([f"idle-{i}" for i in range(len(prompts))])
    return max(0.0, 1.0 - busy / wall_us)


def run(config: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    steps, mode = config.split(":")
    llm = make_llm(args, num_scheduler_steps=int(steps), enforce_eager=mode == "eager")
    params = greedy_params(args.output_len)
    warm = [{"prompt_token_ids": p} for p in prompts[:64]]
    llm.generate(
        warm, SamplingParams(max_tokens=32, ignore_eos=True, detokenize=False), use_tqdm=False
    )
    llm.engine.metrics.__init__()
    llm.engine.reset_prefix_cache()  # the timed prompts must not be found from the warm-up
    outs, seconds = timed(
        lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    )
    m = llm.engine.metrics
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    record = {
        "benchmark": "decode",
        "device": device_name(),
        "num_scheduler_steps": int(steps),
        "cuda_graphs": mode == "graphs",
        "requests": len(prompts),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "quantization": llm.config.model.quantization,
        "kv_cache_dtype": llm.config.cache.kv_cache_dtype,
        "seconds": round(seconds, 2),
        "output_tokens_per_s": round(tokens / seconds, 1),
        "decode_ms_per_step": round(1000 * m.decode_seconds / max(m.decode_steps, 1), 2),
        "gpu_idle_share_of_decode": round(
            gpu_idle_share(llm, prompts[: llm.config.scheduler.max_num_seqs], args.profile_steps), 3
        ),
    }
    return record


def main() -> None:
    ap = argparse.ArgumentParser()
    add_random_workload_args(ap, num_requests=1024, prompt_len=128, output_len=1024)
    ap.add_argument("--configs", default="1:eager,1:graphs,8:eager,8:graphs")
    ap.add_argument("--profile-steps", type=int, default=16)
    args = ap.parse_args()
    prompts = random_prompts(args.num_requests, args.prompt_len, 128256, seed=3)
    for config in args.configs.split(","):
        emit(run(config, prompts, args))
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
