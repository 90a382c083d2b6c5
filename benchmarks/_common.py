"""Shared pieces of the GPU benchmarks: the machine's name and ceilings, random workloads, JSON out."""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

# Ceilings measured on an H100 80GB (benchmarks/HISTORY.md, "Where the time goes"): dense bf16 matmul
# on a cool GPU, and device-to-device copy bandwidth (bytes read + written).
H100_BF16_FLOPS = 798e12
H100_HBM_BYTES_PER_S = 3.0e12

# The 6-field record that structured.py asks for and calibrate.py times its structured jobs on.
EXTRACTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "company": {"type": "string", "maxLength": 24},
        "contact": {"type": "string", "maxLength": 24},
        "category": {"enum": ["invoice", "complaint", "order", "refund", "question"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "urgent": {"type": "boolean"},
        "country": {"enum": ["US", "DE", "FR", "JP", "BR", "IN", "other"]},
    },
    "required": ["company", "contact", "category", "priority", "urgent", "country"],
    "additionalProperties": False,
}


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def shared_prefix_prompts(
    groups: int, per_group: int, prefix_len: int, suffix_len: int, vocab: int, seed: int
) -> list[list[int]]:
    """The canonical BatchLLM workload: `groups` random prefixes, each followed by unique suffixes."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
        prompts += [
            prefix + [rng.randrange(vocab) for _ in range(suffix_len)] for _ in range(per_group)
        ]
    return prompts


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The model and every engine knob, as `prefixgrove run` takes them (flags, PREFIXGROVE_*
    variables): a knob left out takes the engine's own default for the device, so a benchmark runs
    the engine every user gets."""
    from prefixgrove.cli_flags import add_arguments
    from prefixgrove.engine_settings import EngineSettings

    ap.add_argument("--model", default="llama-3.1-8b-random")
    add_arguments(ap, EngineSettings)


def add_canonical_args(ap: argparse.ArgumentParser, groups: int) -> None:
    """The engine's knobs and the canonical workload's, for the scripts that run it."""
    add_engine_args(ap)
    add_canonical_workload_args(ap, groups)


def add_canonical_workload_args(ap: argparse.ArgumentParser, groups: int) -> None:
    """The canonical workload's knobs (DESIGN.md): its groups, their prefix and suffixes, and the
    tokens each request makes."""
    ap.add_argument("--groups", type=int, default=groups)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--suffix-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=100)


def add_random_workload_args(
    ap: argparse.ArgumentParser, num_requests: int, prompt_len: int, output_len: int
) -> None:
    """A workload without sharing: random prompts of one length (throughput.py, decode.py)."""
    add_engine_args(ap)
    ap.add_argument("--num-requests", type=int, default=num_requests)
    ap.add_argument("--prompt-len", type=int, default=prompt_len)
    ap.add_argument("--output-len", type=int, default=output_len)


def make_llm(args: argparse.Namespace, **options: Any) -> Any:
    """The engine add_engine_args' flags (and PREFIXGROVE_* variables) describe, with `options`
    over them (a benchmark mode running FP8 beside bf16, say)."""
    from prefixgrove import LLM
    from prefixgrove.engine_settings import EngineSettings
    from prefixgrove.settings import load

    return LLM(args.model, **load(EngineSettings, args).replace(**options).as_kwargs())


def queue_job(llm: Any, prompts: list[list[int]], params: Any, grouped: bool = True) -> None:
    """Queues every prompt in the engine without running a step (grouped as `generate` groups
    them), so that a benchmark can drive the engine one step at a time."""
    from prefixgrove.engine.request_feed import RequestFeed

    n = len(prompts)
    groups = llm._group(prompts) if grouped else []
    # one window as large as the job: every request is queued before the first step
    RequestFeed(llm.engine, [f"p{i}" for i in range(n)], [None] * n, prompts, [params] * n,
                groups, n).top_up()  # fmt: skip


def greedy_params(max_tokens: int) -> Any:
    """The measured runs' sampling: greedy, exactly `max_tokens` tokens (EOS ignored), token ids
    only (no detokenizing)."""
    from prefixgrove import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


def cuda_ms_per_call(fn: Callable[[], Any], calls: int) -> float:
    """Milliseconds per call of `fn`, called `calls` times back to back on the GPU, by CUDA events
    (no warm-up: the caller's)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def timed(fn: Any) -> tuple[Any, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


class GcClock:
    """Counts the time the interpreter spends in garbage collections while it is entered (a
    `gc.callbacks` hook): host time that no GPU work overlaps when the engine loop is the one waiting.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._began: float | None = None

    def _hook(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self.collections[info["generation"]] += 1
            self._began = None

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._hook)


# The modules of prefixgrove_kernels that hold @triton.jit kernels
KERNEL_MODULES = (
    "activation",
    "cascade_attention",
    "cascade_decode",
    "merge_states",
    "paged_attention",
    "rmsnorm",
    "rotary",
)


def compiled_variants() -> dict[str, int]:
    """How many specialisations of each Triton kernel this process holds (each one a compile, or a
    load from Triton's disk cache): a count that grows inside a timed run means the warm-up missed a
    variant the run needed."""
    return {name: len(keys) for name, keys in compiled_variant_keys().items()}


def compiled_variant_keys() -> dict[str, set[str]]:
    """The specialisation keys (argument kinds and alignments, constexprs) of each Triton kernel's
    variants in this process: what tells two variants of one kernel apart."""
    import importlib

    import triton

    keys: dict[str, set[str]] = {}
    for module in (importlib.import_module(f"prefixgrove_kernels.{n}") for n in KERNEL_MODULES):
        for name, fn in vars(module).items():
            caches = getattr(fn, "device_caches", None)
            if isinstance(fn, triton.runtime.JITFunction) and caches:
                keys[name] = {str(key) for cache in caches.values() for key in cache[0]}
    return keys


def allocator_counts() -> dict[str, int]:
    """The CUDA caching allocator's running counts (torch.cuda.memory_stats): segments taken from and
    given back to the driver, and cache flushes to retry a failed cudaMalloc. Each of these stalls
    the host, a flush-and-retry the whole device; a warm run should do none. Zeros without CUDA."""
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return {
        "device_mallocs": stats.get("num_device_alloc", 0),
        "device_frees": stats.get("num_device_free", 0),
        "alloc_retries": stats.get("num_alloc_retries", 0),
    }


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)
    sys.stdout.flush()


# --- the agreement benchmarks (trained_agreement.py, fp8_agreement.py) ----------------------------
SYSTEMS = [
    "You are a concise assistant for a botanical garden. It opens at 9:00 and closes at 18:00, "
    "Tuesday to Sunday. Tickets cost 12 euros for adults and 6 euros for children.",
    "You are a helpful tutor. Explain things simply, in two or three sentences.",
    "You answer questions about cooking. Be practical and brief.",
    "You are a travel guide for Lisbon. Mention one place to visit when it fits.",
]
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "When does the garden open?",
    "How much is a child ticket?", "Name three colours.", "What is two plus two?",
    "Why is the sky blue?", "Say hello in Spanish.", "What do bees make?",
    "Give me a word that rhymes with cat.", "What is the largest planet?", "Who wrote Hamlet?",
    "What season comes after winter?", "How many legs does a spider have?",
    "What is water made of?", "Suggest a name for a cat.",
]  # fmt: skip


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """`n` chat prompts (a system message of SYSTEMS, a question of QUESTIONS) as token ids, with the
    generation prompt, through `tokenizer`'s chat template."""
    conversations = [
        [{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]},
         {"role": "user", "content": QUESTIONS[(i // len(SYSTEMS) + i) % len(QUESTIONS)]}]
        for i in range(n)
    ]  # fmt: skip
    return [
        list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                           return_dict=False))
        for c in conversations
    ]  # fmt: skip


def prompt_scores(llm: Any, sequences: list[list[int]]) -> list[Any]:
    """The engine's prompt logprobs of each whole sequence: per position, the token's logprob and
    the engine's top-1 token."""
    from prefixgrove import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [out.prompt_logprobs for out in outs]


def top1(entry: Any) -> int:
    """The top-1 token of one position of prompt_scores."""
    return int(next(tok for tok, lp in entry.items() if lp.rank == 1))


def teacher_forced(
    prompts: list[list[int]], sequences: list[list[int]], ref: list[Any], ours: list[Any]
) -> Iterator[tuple[int, int, Any, Any]]:
    """Every position i of every continuation (sequence[len(prompt):], the token at i predicted from
    the tokens before it): i, the token at i, and the two sides' scores of that sequence."""
    for prompt, seq, ref_lp, our_lp in zip(prompts, sequences, ref, ours, strict=True):
        for i in range(len(prompt), len(seq)):
            yield i, seq[i], ref_lp, our_lp


# The checkout's source roots, each holding one package (scripts/gpu-pythonpath.sh prints the same).
SOURCE_ROOTS = ("services", "kernels", "operator", "proto")


def ensure_prefixgrove() -> None:
    """Makes this checkout importable when prefixgrove is not installed: puts its source roots on
    sys.path, as scripts/gpu-pythonpath.sh puts them on PYTHONPATH."""
    try:
        import prefixgrove_kernels.cascade_attention  # noqa: F401

        return
    except ImportError:
        pass
    for root in reversed(SOURCE_ROOTS):
        path = str(ROOT / root)
        if path not in sys.path:
            sys.path.insert(0, path)


def as_graph(fn: Callable[[], Any]) -> Callable[[], Any]:
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


# Bytes read before each timed call by median_us_clean_l2: five times the H100's 50 MB L2.
EVICT_BYTES = 256 * 1024 * 1024


def median_us_clean_l2(
    fn: Callable[[], Any], device: str, use_graph: bool, reps: int = 200
) -> float:
    """Median microseconds of fn with the L2 emptied of its data before each call by *reading* a
    256 MB buffer, so that fn starts from a cold L2 holding only clean lines. That is what a decode
    step's attention finds in the engine, right after the QKV projection read ~50 MB of weights.
    triton.testing.do_bench (median_us) empties the L2 by *writing* 256 MB instead, which leaves the
    L2 full of dirty lines that the timed kernel then writes back while it reads: the one-pass decode
    kernel pays for them, the plain kernel next to nothing (benchmarks/HISTORY.md, "Kernels", the
    do_bench column). CPU (interpreter smoke runs): wall time, as median_us."""
    if device == "cpu":
        return median_us(fn, device, use_graph)
    run = as_graph(fn) if use_graph else fn
    buffer = torch.zeros(EVICT_BYTES // 4, dtype=torch.int32, device=device)
    total = torch.empty((), dtype=torch.int64, device=device)

    def evict() -> None:
        torch.sum(buffer, dim=0, out=total)

    for _ in range(10):  # warm-up
        evict()
        run()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        evict()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) * 1e3


def median_us(fn: Callable[[], Any], device: str, use_graph: bool) -> float:
    if device == "cpu":  # interpreter smoke run: wall time
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6
    run = as_graph(fn) if use_graph else fn
    import triton

    result = triton.testing.do_bench(run, warmup=25, rep=200, quantiles=[0.5])
    return float(result[0] if isinstance(result, list | tuple) else result) * 1e3
