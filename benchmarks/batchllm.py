"""The canonical shared-prefix workload (DESIGN.md, from the BatchLLM RFC): Llama-3.1-8B shapes, random
weights, bf16; groups of 16 requests sharing a 2,000-token random prefix, each with 200 unique tokens and 100
output tokens, EOS ignored; 400 groups (6,400 requests) for the full run.

Modes, each on a fresh engine in this one process (so their ratios are measured side by side):
  shuffled-nogroup  input shuffled, no grouping (every request prefills its whole prompt)
  sorted-nogroup    input sorted by prefix, no grouping
  group-nocascade   shuffled input, global grouping (prefix computed once, KV blocks shared), plain kernel
  group-cascade     shuffled input, global grouping and cascade attention (decode steps on the one-pass
                    cascade decode kernel, the engine's default on CUDA)
  group-cascade-two-pass  the same, with decode steps on the two passes (prefix pass, then a suffix
                    pass that merges; cascade_decode_kernel="two-pass")
  group-cascade-all-rows  group-cascade with the model's last layer computing every row of a step
                    instead of only the rows that sample a token (narrow_last_layer=False)
  group-cascade-sync  group-cascade with every prefill step waiting for the previous step's tokens
                    before it is scheduled (async_scheduling=False)
  group-cascade-unfused  group-cascade with prefill steps' suffix chunks taking the two passes
                    instead of being finished in the prefix pass (cascade_prefill_kernel="two-pass")
  group-cascade-fp8  group-cascade with FP8 W8A8 linear layers (quantization="fp8"), whatever
                    --quantization says, so that bf16 and FP8 run side by side
  group-cascade-fp8-kv  group-cascade-fp8 with an FP8 KV cache as well (kv_cache_dtype="fp8")
  group-cascade-one-level  group-cascade grouped by BatchLLM's one-level rule (decode reads saved
                    only: grouping.py's decode_weight taken as unbounded), against the default rule
                    that counts the prefix cache; they differ where sharing nests (--system-len)
With --system-len N every prompt starts with one N-token system prompt before its group's prefix (a
document), as in a job asking a few questions about each of many documents; --keep-order leaves a
document's requests side by side, as such a job lists them, instead of shuffling the input.
A mode may be named more than once (alternating runs in one process share its warm kernel caches).
Prints one JSON line per mode. Usage: python benchmarks/batchllm.py [--groups 400] [--modes a,b]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
from dataclasses import dataclass
from typing import Any

import torch

from prefixgrove import LLM, SamplingParams
from prefixgrove.grouping import GroupingConfig, GroupingResult, group_prompts

from _common import (
    GcClock,
    add_canonical_args,
    allocator_counts,
    compiled_variant_keys,
    device_name,
    emit,
    greedy_params,
    make_llm,
    shared_prefix_prompts,
    timed,
)

MODES = (
    "shuffled-nogroup",
    "sorted-nogroup",
    "group-nocascade",
    "group-cascade",
    "group-cascade-two-pass",
    "group-cascade-all-rows",
    "group-cascade-sync",
    "group-cascade-unfused",
    "group-cascade-fp8",
    "group-cascade-fp8-kv",
    "group-cascade-one-level",
)
ONE_LEVEL = 1e12  # a decode weight past any job's tokens: grouping's rule becomes BatchLLM's


# Groups the warm-up takes beyond those that fit at once (max_num_seqs): later ones are admitted
# while earlier ones decode, as in the run.
WARM_EXTRA_GROUPS = 8


def make_engine(mode: str, args: argparse.Namespace) -> LLM:
    fp8: dict[str, Any] = {}
    if mode.startswith("group-cascade-fp8"):
        fp8["quantization"] = "fp8"
    if mode == "group-cascade-fp8-kv":
        fp8["kv_cache_dtype"] = "fp8"
    llm = make_llm(
        args,
        **fp8,
        enable_cascade_attention=mode.startswith("group-cascade"),
        cascade_decode_kernel="two-pass" if mode == "group-cascade-two-pass" else "one-pass",
        cascade_prefill_kernel="two-pass" if mode == "group-cascade-unfused" else "fused",
        async_scheduling=mode != "group-cascade-sync",
    )
    if mode == "group-cascade-all-rows":
        llm.engine.runner.builder.narrow_last_layer = False
    return llm


def warm_up(llm: LLM, prompts: list[list[int]], args: argparse.Namespace) -> None:
    """Runs groups of the workload's own shape, so that the kernels the run needs (grouped prefill,
    cascade decode) are compiled before the clock starts, as they are on a machine whose Triton
    cache is warm: more groups than fit at once, so that its steps hold what the run's do, new
    prefixes' long prefills beside other groups' suffixes and beside decoding groups."""
    warm_groups = llm.config.scheduler.max_num_seqs // args.per_group + WARM_EXTRA_GROUPS
    warm = [{"prompt_token_ids": p} for p in sorted(prompts)[: warm_groups * args.per_group]]
    llm.generate(
        warm, SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False), use_tqdm=False
    )
    llm.engine.metrics.__init__()
    llm.engine.reset_prefix_cache()  # the run's prefixes must not be found from the warm-up
    torch.cuda.reset_peak_memory_stats()


@dataclass
class TimedJob:
    outputs: list[Any]
    seconds: float  # grouping and generation
    grouping_seconds: float
    gc_clock: GcClock
    variants_added: dict[str, set[str]]  # kernel: variants compiled (or loaded) during the run
    allocator: dict[str, int]  # the caching allocator's counts during the run


def run_job(llm: LLM, mode: str, prompts: list[list[int]], output_len: int) -> TimedJob:
    """The timed job: grouping (when the mode groups) and generation, with what happened beside
    them (garbage collections, kernel variants compiled, the allocator's activity)."""
    inputs = sorted(prompts) if mode == "sorted-nogroup" else prompts
    config = GroupingConfig(block_size=llm.config.cache.block_size)
    if mode == "group-cascade-one-level":
        config = GroupingConfig(block_size=config.block_size, decode_weight=ONE_LEVEL)
    groups = GroupingResult([], list(range(len(inputs))), len(inputs), 0)
    grouping_s = 0.0
    params = greedy_params(output_len)
    variants_before = compiled_variant_keys()
    allocator_before = allocator_counts()
    with GcClock() as gc_clock:
        if mode.startswith("group"):  # grouping is part of the job: its time counts
            groups, grouping_s = timed(lambda: group_prompts(inputs, config))
        outs, generate_s = timed(
            lambda: llm.generate(
                [{"prompt_token_ids": p} for p in inputs],
                params,
                use_tqdm=False,
                groups=groups.groups,
            )
        )
    added = {
        name: new
        for name, keys in compiled_variant_keys().items()
        if (new := keys - variants_before.get(name, set()))
    }
    allocator = {k: v - allocator_before[k] for k, v in allocator_counts().items()}
    return TimedJob(outs, grouping_s + generate_s, grouping_s, gc_clock, added, allocator)


def report(mode: str, llm: LLM, prompts: list[list[int]], job: TimedJob) -> dict:
    m = llm.engine.metrics
    seconds = job.seconds
    out_tokens = sum(len(o.outputs[0].token_ids) for o in job.outputs)
    return {
        "benchmark": "batchllm",
        "mode": mode,
        "device": device_name(),
        "requests": len(prompts),
        "seconds": round(seconds, 2),
        "requests_per_s": round(len(prompts) / seconds, 2),
        "output_tokens_per_s": round(out_tokens / seconds, 1),
        "total_tokens_per_s": round((sum(map(len, prompts)) + out_tokens) / seconds, 1),
        "grouping_seconds": round(job.grouping_seconds, 3),
        "prefill_tokens": m.prefill_tokens,
        "prefix_tokens_reused": m.prefix_tokens_reused,
        "kv_blocks_shared": m.kv_blocks_shared,
        "preemptions": m.preemptions,
        "decode_steps": m.decode_steps,
        "decode_seconds": round(m.decode_seconds, 2),
        "mixed_seconds": round(m.mixed_seconds, 2),
        "steps_launched_ahead": m.steps_launched_ahead,
        "host_seconds": round(m.host_seconds, 2),
        "intake_seconds": round(m.intake_seconds, 2),
        "gc_seconds": round(job.gc_clock.seconds, 2),
        "gc_collections": job.gc_clock.collections,
        # kernel: variants the run compiled (or loaded from disk) that its warm-up had not needed
        "kernel_variants_added": {name: len(keys) for name, keys in job.variants_added.items()},
        "num_scheduler_steps": llm.config.scheduler.num_scheduler_steps,
        "max_num_seqs": llm.config.scheduler.max_num_seqs,
        "max_num_batched_tokens": llm.config.scheduler.max_num_batched_tokens,
        "tensor_parallel_size": llm.config.tensor_parallel_size,
        "kv_blocks_per_rank": llm.engine.blocks.num_usable,
        # rank 0's; every rank holds the same share of weights and cache
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        # the caching allocator during the run: segments it had to get from (or give back to) the
        # driver, and times it freed its whole cache to retry a failed cudaMalloc (each syncs)
        **job.allocator,
    }


def run_mode(mode: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    llm = make_engine(mode, args)
    warm_up(llm, prompts, args)
    job = run_job(llm, mode, prompts, args.output_len)
    for name, keys in job.variants_added.items():  # what the warm-up missed, for stderr's reader
        for key in keys:
            print(f"kernel variant compiled in the run: {name} {key}", file=sys.stderr)
    record = report(mode, llm, prompts, job)
    llm.engine.close()  # a tensor-parallel engine's other ranks end with it
    return record


def main() -> None:
    ap = argparse.ArgumentParser()
    add_canonical_args(ap, groups=400)
    # the FP8 modes run when named (they are a comparison of their own)
    ap.add_argument("--modes", default=",".join(m for m in MODES if "fp8" not in m))
    ap.add_argument("--system-len", type=int, default=0, help="a system prompt before every prefix")
    ap.add_argument("--keep-order", action="store_true",
                    help="a group's requests side by side, as a job lists them, not shuffled")  # fmt: skip
    args = ap.parse_args()
    vocab = 128256
    prompts = shared_prefix_prompts(
        args.groups, args.per_group, args.prefix_len, args.suffix_len, vocab, seed=0
    )
    system = random.Random(2).choices(range(vocab), k=args.system_len)
    prompts = [system + p for p in prompts]
    if not args.keep_order:
        random.Random(1).shuffle(prompts)
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        emit(run_mode(mode, prompts, args))
        gc.collect()  # the mode's engine is gone: give its memory back before the next one
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
