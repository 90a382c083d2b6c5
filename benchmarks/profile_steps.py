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
from prefixgrove.engine.sampling import sampler as sampler_module

from _common import (
    H100_BF16_FLOPS,
    add_canonical_args,
    compiled_variants,
    device_name,
    emit,
    greedy_params,
    make_llm,
    queue_job,
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


KINDS = ("mixed", "decode")


def parse_args() -> argparse.Namespace:
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
    return ap.parse_args()


def model_flops_per_token(model: torch.nn.Module) -> int:
    """2 x the non-embedding parameters: the matmul work of one token through the model."""
    embed = sum(p.numel() for n, p in model.named_parameters() if "embed" in n or "lm_head" in n)
    return 2 * (sum(p.numel() for p in model.parameters()) - embed)


def submit_job(llm: LLM, args: argparse.Namespace) -> int:
    """Warms the engine up on a tiny grouped job, then queues the whole job without running it, so
    that the caller can drive it one step at a time. Returns the number of requests."""
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
    params = greedy_params(args.output_len)
    queue_job(llm, prompts, params)
    return len(prompts)


def record_decode_batches(builder: Any) -> list[tuple[int, int, int]]:
    """Wraps the input builder's plan so that every decode-only batch it plans is recorded as
    (rows, groups, ungrouped rows); returns the list it fills."""
    batches: list[tuple[int, int, int]] = []
    plan = builder.plan

    def recording_plan(batch: list) -> Any:
        order, groups = plan(batch)
        if all(item.num_tokens == 1 for item in order):
            in_groups = sum(len(r) for r in groups)
            batches.append((len(order), len(groups), len(order) - in_groups))
        return order, groups

    builder.plan = recording_plan
    return batches


def time_host_stages(engine: Any) -> HostTimers:
    runner = engine.runner
    timers = HostTimers()
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.windows, "size", "reserve_window")
    timers.wrap(runner.builder, "plan", "plan")
    timers.wrap(runner.builder, "fill", "fill_and_upload")
    timers.wrap(sampler_module.SamplingBatch, "build", "sampling_settings")
    timers.wrap(runner, "_wait", "wait_for_tokens")
    return timers


class StepLog:
    """Runs engine steps and adds each one to its kind's totals ("mixed": prefill+decode steps,
    "decode": decode-only windows), with the host time spent in each wrapped stage during it."""

    def __init__(self, engine: Any, timers: HostTimers) -> None:
        self.engine = engine
        self.timers = timers
        self.kinds: dict[str, dict[str, float]] = {k: defaultdict(float) for k in KINDS}
        self.host: dict[str, dict[str, float]] = {k: defaultdict(float) for k in KINDS}
        self.steps: list[tuple[str, int, int, float]] = []  # kind, prefill, decode tokens, ms

    def step(self) -> None:
        m = self.engine.metrics
        before = (m.mixed_seconds, m.decode_seconds, m.prefill_tokens, m.decode_tokens, m.steps)
        host_before = dict(self.timers.seconds)
        start = time.perf_counter()
        self.engine.step()
        wall = time.perf_counter() - start
        kind = "mixed" if m.mixed_seconds != before[0] else "decode"
        prefill, decode = m.prefill_tokens - before[2], m.decode_tokens - before[3]
        self.steps.append((kind, prefill, decode, wall * 1000))
        k = self.kinds[kind]
        k["calls"] += 1
        k["wall_s"] += wall
        k["prefill_tokens"] += prefill
        k["decode_tokens"] += decode
        k["model_steps"] += m.steps - before[4]
        for label, s in self.timers.seconds.items():
            self.host[kind][label] += s - host_before.get(label, 0.0)


class Tracer:
    """Profiles the GPU kernels of the first few mixed steps and full decode windows, and keeps the
    kernel table of the last traced step of each kind."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.traced = dict.fromkeys(KINDS, 0)
        self.tables: dict[str, str] = {}

    def limit(self, kind: str) -> int:
        return self.args.trace_decode if kind == "decode" else self.args.trace_mixed

    def wants(self, engine: Any, steps_seen: int) -> str | None:
        """The kind of the next step if it should be traced: a decode window of a nearly full
        batch, or a mixed step after the first four."""
        running = engine.scheduler.running
        full_decode = len(running) >= engine.config.scheduler.max_num_seqs * 0.9 and all(
            s.is_decoding for s in running
        )
        waiting_prefill = any(not s.is_decoding for s in running)
        if full_decode and self.traced["decode"] < self.limit("decode"):
            return "decode"
        if waiting_prefill and steps_seen > 4 and self.traced["mixed"] < self.limit("mixed"):
            return "mixed"
        return None

    def trace(self, kind: str, step: Callable[[], None]) -> None:
        # The traced step still counts in the totals: tracing kernels only costs little.
        sync()
        cpu = bool(self.args.cpu_trace) and kind == "mixed" and self.traced["mixed"] == 0
        on_gpu = torch.cuda.is_available()
        activities = [ProfilerActivity.CUDA] if on_gpu else []
        activities += [ProfilerActivity.CPU] if cpu or not on_gpu else []
        with profile(activities=activities) as prof:
            step()
            sync()
        if cpu:
            print("--- CPU time of one mixed step, by self CPU time ---")
            print(
                prof.key_averages().table(
                    sort_by="self_cpu_time_total",
                    row_limit=self.args.rows,
                    max_name_column_width=70,
                )
            )
            prof.export_chrome_trace(self.args.cpu_trace)
        self.traced[kind] += 1
        if self.traced[kind] == self.limit(kind):
            self.tables[kind] = kernel_table(prof, self.args.rows)


def run_to_completion(engine: Any, log: StepLog, tracer: Tracer) -> None:
    steps_seen = 0
    while engine.has_unfinished_requests():
        steps_seen += 1
        kind = tracer.wants(engine, steps_seen)
        if kind is None:
            log.step()
        else:
            tracer.trace(kind, log.step)


def kind_summary(
    k: dict[str, float], host: dict[str, float], flops_per_token: int
) -> dict[str, Any]:
    tokens = k["prefill_tokens"] + k["decode_tokens"]
    entry: dict[str, Any] = {name: round(v, 3) for name, v in k.items()}
    entry["model_tflops"] = round(tokens * flops_per_token / max(k["wall_s"], 1e-9) / 1e12, 1)
    entry["mfu"] = round(tokens * flops_per_token / max(k["wall_s"], 1e-9) / H100_BF16_FLOPS, 3)
    if k["model_steps"]:
        entry["ms_per_model_step"] = round(1000 * k["wall_s"] / k["model_steps"], 2)
    entry["host_ms_per_call"] = {
        label: round(1000 * s / max(k["calls"], 1), 3) for label, s in sorted(host.items())
    }
    return entry


def mixed_step_extremes(steps: list[tuple[str, int, int, float]]) -> dict[str, Any]:
    mixed = sorted((r for r in steps if r[0] == "mixed"), key=lambda r: -r[3])

    def rows(chosen: list[tuple[str, int, int, float]]) -> list[dict[str, Any]]:
        return [{"prefill": r[1], "decode": r[2], "ms": round(r[3], 1)} for r in chosen]

    return {"slowest_mixed_steps": rows(mixed[:6]), "fastest_mixed_steps": rows(mixed[-3:])}


def decode_batch_summary(batches: list[tuple[int, int, int]]) -> dict[str, int]:
    rows, groups, ungrouped = (sorted(col) for col in zip(*batches, strict=True))
    return {
        "count": len(batches),
        "median_rows": rows[len(rows) // 2],
        "median_groups": groups[len(groups) // 2],
        "max_groups": groups[-1],
        "median_ungrouped_rows": ungrouped[len(ungrouped) // 2],
        "max_ungrouped_rows": ungrouped[-1],
    }


def device_memory_summary() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {
        "allocator": {
            k: stats.get(k) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")
        },
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
    }


def main() -> None:
    args = parse_args()
    llm = make_llm(
        args,
        enable_cascade_attention=bool(args.cascade),
        cascade_decode_kernel="two-pass" if args.two_pass_decode else "one-pass",
    )
    engine = llm.engine
    flops_per_token = model_flops_per_token(engine.runner.model)
    requests = submit_job(llm, args)
    batches = record_decode_batches(engine.runner.builder)
    log = StepLog(engine, time_host_stages(engine))
    tracer = Tracer(args)
    run_to_completion(engine, log, tracer)

    for kind, table in tracer.tables.items():
        print(f"--- top kernels, one traced {kind} step ---")
        print(table)
    summary: dict[str, Any] = {
        "benchmark": "profile_steps",
        "device": device_name(),
        "requests": requests,
        "cascade": args.cascade,
        "flops_per_token": flops_per_token,
    }
    for kind, k in log.kinds.items():
        summary[kind] = kind_summary(k, log.host[kind], flops_per_token)
    summary.update(mixed_step_extremes(log.steps))
    if batches:
        summary["decode_batches"] = decode_batch_summary(batches)
    summary["compiled_variants"] = compiled_variants()
    summary.update(device_memory_summary())
    emit(summary)


if __name__ == "__main__":
    main()
