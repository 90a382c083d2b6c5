"""Throughput without prefix sharing (issue "Engine core"): Llama-3.1-8B shapes, random weights, bf16,
1,000 requests of 1,000 random prompt tokens and 200 output tokens, EOS ignored.

Prints one JSON line: requests/s, output tokens/s, prefill MFU and decode HBM bandwidth use against the
H100's measured ceilings. Usage: python benchmarks/throughput.py [--num-requests N] [--num-scheduler-steps K] (every engine knob: --help)
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from prefixgrove import LLM, SamplingParams

import _common as common
from _common import H100_BF16_FLOPS, H100_HBM_BYTES_PER_S


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    common.add_random_workload_args(ap, num_requests=1000, prompt_len=1000, output_len=200)
    return ap.parse_args()


def measure(llm: LLM, prompts: list[dict], output_len: int) -> tuple[list[Any], float, float]:
    """Times the prompts' prefill alone (one output token each), then the whole run; returns the
    run's outputs, its seconds and the prefill's seconds."""
    llm.generate(
        prompts[:32],
        SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False),
        use_tqdm=False,
    )  # warm-up: kernel compilation, allocator
    _, prefill_s = common.timed(
        lambda: llm.generate(prompts, common.greedy_params(1), use_tqdm=False)
    )
    llm.engine.metrics.__init__()
    params = common.greedy_params(output_len)
    outs, total_s = common.timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    return outs, total_s, prefill_s


def hardware_use(llm: LLM, args: argparse.Namespace, prefill_s: float) -> dict[str, float]:
    """Prefill MFU (matmuls and causal attention) and decode HBM use (weights read once a step,
    plus every context's KV) against the H100's measured ceilings."""
    arch, m = llm.config.model.arch, llm.engine.metrics
    prompt_tokens = args.num_requests * args.prompt_len
    attn_flops = 2 * 2 * arch.num_layers * arch.q_size * args.num_requests * args.prompt_len**2 / 2
    prefill_flops = 2 * arch.num_params * prompt_tokens + attn_flops
    weight_bytes = 2 * arch.num_params
    kv_bytes_per_token = 2 * arch.num_layers * arch.kv_size * 2
    decode_bytes = m.decode_steps * weight_bytes + m.decode_kv_tokens * kv_bytes_per_token
    return {
        "prefill_mfu": round(prefill_flops / prefill_s / H100_BF16_FLOPS, 3),
        "decode_hbm_utilization": round(
            decode_bytes / max(m.decode_seconds, 1e-9) / H100_HBM_BYTES_PER_S, 3
        ),
    }


def main() -> None:
    args = parse_args()
    llm = common.make_llm(args)
    vocab = llm.config.model.arch.vocab_size
    prompts = [
        {"prompt_token_ids": p}
        for p in common.random_prompts(args.num_requests, args.prompt_len, vocab, seed=1)
    ]
    outs, total_s, prefill_s = measure(llm, prompts, args.output_len)
    m = llm.engine.metrics
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    use = hardware_use(llm, args, prefill_s)
    common.emit(
        {
            "benchmark": "throughput",
            "device": common.device_name(),
            "torch": torch.__version__,
            "model": args.model,
            "requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "num_scheduler_steps": llm.config.scheduler.num_scheduler_steps,
            "enforce_eager": llm.config.enforce_eager,
            "max_num_seqs": llm.config.scheduler.max_num_seqs,
            "seconds": round(total_s, 2),
            "requests_per_s": round(args.num_requests / total_s, 2),
            "output_tokens_per_s": round(output_tokens / total_s, 1),
            "prefill_seconds": round(prefill_s, 2),
            "prefill_mfu": use["prefill_mfu"],
            "decode_steps": m.decode_steps,
            "decode_ms_per_step": round(1000 * m.decode_seconds / max(m.decode_steps, 1), 2),
            "decode_hbm_utilization": use["decode_hbm_utilization"],
            "preemptions": m.preemptions,
            "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)
            if torch.cuda.is_available()
            else None,
        }
    )


if __name__ == "__main__":
    main()
