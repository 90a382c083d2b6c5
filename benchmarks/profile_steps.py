"""Where a shared-prefix run's time goes, step by step (a diagnostic for batchllm.py's workload).

Runs the canonical workload (or a smaller number of groups) through the engine one `step()` at a time and
prints:
  - per kind of step (mixed prefill+decode, decode-only window): count, wall seconds, tokens, and the
    model's matmul TFLOP/s (2 x non-embedding parameters per token) against the H100's measured ceiling;
  - the CPU time of each host stage per decode window (scheduling, planning, filling the arena, sampling
    settings, handling the sampled tokens), timed by wrapping those functions;
  - torch profiler tables of the top GPU kernels over a few mixed steps and a few decode windows.
Usage: python benchmarks/profile_steps.py [--groups 64] [--cascade 1] [--trace-mixed 3] [--trace-decode 2]
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from prefixgrove import LLM, SamplingParams
from prefixgrove.engine import sampler as sampler_module

from _common import (
    H100_BF16_FLOPS,
    add_canonical_args,
    compiled_variants,
    device_name,
    emit,
    shared_prefix_prompts,
)


class HostTimers:
    """Accumulates the wall time of wrapped functions (CPU work: the GPU runs asynchronously)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start

        setattr(owner, name, timed)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_table(prof: Any, rows: int) -> str:
    return prof.key_averages().table(
        sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    add_canonical_args(ap, groups=64)
    ap.add_argument("--cascade", type=int, default=1)
    ap.add_argument(
        "--two-pass-decode",
        action="store_true",
        help="decode steps on the two cascade passes instead of the one-pass decode kernel",
    )
    ap.add_argument("--trace-mixed", type=int, default=3, help="mixed steps to trace (0: none)")
    ap.add_argument("--trace-decode", type=int, default=2, help="decode windows to trace")
    ap.add_argument("--rows", type=int, default=18, help="kernels per table")
    ap.add_argument(
        "--cpu-trace",
        default=None,
        help="also trace CPU activity of one mixed step and write a Chrome trace to this path",
    )
    args = ap.parse_args()

    llm = LLM(
        args.model,
        dtype="bfloat16",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_cascade_attention=bool(args.cascade),
        cascade_decode_kernel="two-pass" if args.two_pass_decode else "one-pass",
    )
    engine, runner = llm.engine, llm.engine.runner
    model = runner.model
    embed = sum(p.numel() for n, p in model.named_parameters() if "embed" in n or "lm_head" in n)
    flops_per_token = 2 * (sum(p.numel() for p in model.parameters()) - embed)

    vocab = llm.config.model.arch.vocab_size
    warm = shared_prefix_prompts(2, 4, 256, 32, vocab, seed=7)
    llm.generate(
        [{"prompt_token_ids": p} for p in warm],
        SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False),
        use_tqdm=False,
    )
    prompts = shared_prefix_prompts(
        args.groups, args.per_group, args.prefix_len, args.suffix_len, vocab, seed=0
    )
    random.Random(1).shuffle(prompts)
    params = SamplingParams(
        max_tokens=args.output_len, temperature=0.0, ignore_eos=True, detokenize=False
    )
    ids = [f"p{i}" for i in range(len(prompts))]
    llm._submit(ids, [None] * len(prompts), prompts, [params] * len(prompts), llm._group(prompts))

    batches: list[
        tuple[int, int, int]
    ] = []  # per planned decode batch: rows, groups, ungrouped rows
    plan = runner.builder.plan

    def recording_plan(batch: list) -> Any:
        order, groups = plan(batch)
        if all(item.num_tokens == 1 for item in order):
            in_groups = sum(len(r) for r in groups)
            batches.append((len(order), len(groups), len(order) - in_groups))
        return order, groups

    runner.builder.plan = recording_plan  # type: ignore[method-assign]
    timers = HostTimers()
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine, "_window", "reserve_window")
    timers.wrap(runner.builder, "plan", "plan")
    timers.wrap(runner.builder, "fill", "fill_and_upload")
    timers.wrap(sampler_module.SamplingBatch, "build", "sampling_settings")
    timers.wrap(runner, "_wait", "wait_for_tokens")

    kinds: dict[str, dict[str, float]] = {k: defaultdict(float) for k in ("mixed", "decode")}
    host_by_kind: dict[str, dict[str, float]] = {k: defaultdict(float) for k in kinds}
    traced = {"mixed": 0, "decode": 0}
    tables: dict[str, str] = {}
    m = engine.metrics

    def one_step(trace: Callable[[], Any] | None) -> None:
        before = (m.mixed_seconds, m.decode_seconds, m.prefill_tokens, m.decode_tokens, m.steps)
        host_before = dict(timers.seconds)
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        kind = "mixed" if m.mixed_seconds != before[0] else "decode"
        records.append(
            (kind, m.prefill_tokens - before[2], m.decode_tokens - before[3], wall * 1000)
        )
        k = kinds[kind]
        k["calls"] += 1
        k["wall_s"] += wall
        k["prefill_tokens"] += m.prefill_tokens - before[2]
        k["decode_tokens"] += m.decode_tokens - before[3]
        k["model_steps"] += m.steps - before[4]
        for label, s in timers.seconds.items():
            host_by_kind[kind][label] += s - host_before.get(label, 0.0)

    records: list[tuple[str, int, int, float]] = []
    steps_seen = 0
    while engine.has_unfinished_requests():
        steps_seen += 1
        running = engine.scheduler.running
        full_decode = len(running) >= args.max_num_seqs * 0.9 and all(
            s.is_decoding for s in running
        )
        waiting_prefill = any(not s.is_decoding for s in running)
        want = (
            "decode"
            if full_decode and traced["decode"] < args.trace_decode
            else "mixed"
            if waiting_prefill and steps_seen > 4 and traced["mixed"] < args.trace_mixed
            else None
        )
        if want is None:
            one_step(None)
            continue
        sync()
        cpu = bool(args.cpu_trace) and want == "mixed" and traced["mixed"] == 0
        on_gpu = torch.cuda.is_available()
        activities = [ProfilerActivity.CUDA] if on_gpu else []
        activities += [ProfilerActivity.CPU] if cpu or not on_gpu else []
        with profile(activities=activities) as prof:
            one_step(None)
            sync()
        if cpu:
            print("--- CPU time of one mixed step, by self CPU time ---")
            print(
                prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70
                )
            )
            prof.export_chrome_trace(args.cpu_trace)
        traced[want] += 1
        if traced[want] == (args.trace_decode if want == "decode" else args.trace_mixed):
            tables[want] = kernel_table(prof, args.rows)
        # A traced step still counts in the totals: tracing kernels only costs little.

    for kind, table in tables.items():
        print(f"--- top kernels, one traced {kind} step ---")
        print(table)
    summary: dict[str, Any] = {
        "benchmark": "profile_steps",
        "device": device_name(),
        "requests": len(prompts),
        "cascade": args.cascade,
        "flops_per_token": flops_per_token,
    }
    for kind, k in kinds.items():
        tokens = k["prefill_tokens"] + k["decode_tokens"]
        entry = {name: round(v, 3) for name, v in k.items()}
        entry["model_tflops"] = round(tokens * flops_per_token / max(k["wall_s"], 1e-9) / 1e12, 1)
        entry["mfu"] = round(tokens * flops_per_token / max(k["wall_s"], 1e-9) / H100_BF16_FLOPS, 3)
        if k["model_steps"]:
            entry["ms_per_model_step"] = round(1000 * k["wall_s"] / k["model_steps"], 2)
        entry["host_ms_per_call"] = {
            label: round(1000 * s / max(k["calls"], 1), 3)
            for label, s in sorted(host_by_kind[kind].items())
        }
        summary[kind] = entry
    mixed = sorted((r for r in records if r[0] == "mixed"), key=lambda r: -r[3])
    summary["slowest_mixed_steps"] = [
        {"prefill": r[1], "decode": r[2], "ms": round(r[3], 1)} for r in mixed[:6]
    ]
    summary["fastest_mixed_steps"] = [
        {"prefill": r[1], "decode": r[2], "ms": round(r[3], 1)} for r in mixed[-3:]
    ]
    if batches:
        rows, groups, ungrouped = (sorted(col) for col in zip(*batches, strict=True))
        summary["decode_batches"] = {
            "count": len(batches),
            "median_rows": rows[len(rows) // 2],
            "median_groups": groups[len(groups) // 2],
            "max_groups": groups[-1],
            "median_ungrouped_rows": ungrouped[len(ungrouped) // 2],
            "max_ungrouped_rows": ungrouped[-1],
        }
    summary["compiled_variants"] = compiled_variants()
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        summary["allocator"] = {
            k: stats.get(k) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")
        }
        summary["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    emit(summary)


if __name__ == "__main__":
    main()
